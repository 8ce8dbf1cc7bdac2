"""`tandem certs FOLDER NAME:ROLE[+ROLE][@HOST[,HOST]] ...`: a cluster CA and one certificate
per process, for a deployment's mutual TLS and its etcd (docs/security.md).

Each certificate is for server and client use, names its roles as URI subject alternative
names (tandem://role/ROLE; `etcd` for etcd's own), its instance (tandem://instance/NAME: a
worker holding it registers under instance id NAME, so give each process its own) and, as DNS
or IP names, the loopback names, every `--host` and the hosts after its `@`. The CA's files
(ca.pem, ca-key.pem) are made on the first run and reused by later ones on the same folder, so
a host added later gets a certificate of the same CA. Keys are written mode 0600: give each
process its own pair and keep ca-key.pem off the serving hosts.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import sys

ROLES = ("router", "prefill", "decode", "client", "admin", "etcd")
MAX_DAYS = 36500  # a certificate's dates end at year 9999; a century is plenty
_DNS_NAME = re.compile(r"(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9])?)*\.?")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="make a cluster CA and one certificate per process (mutual TLS, etcd)")
    p.add_argument("folder", help="where ca.pem, ca-key.pem and NAME.pem / NAME-key.pem go (the CA is "
                                  "reused if it is there)")
    p.add_argument("processes", nargs="+", metavar="NAME:ROLE[+ROLE][@HOST[,HOST]]",
                   help=f"one certificate per entry (NAME: its file name and a worker's instance id); roles: "
                        f"{', '.join(ROLES)}; e.g. decode-0:decode@10.0.0.7")
    p.add_argument("--host", action="append", default=[],
                   help="a DNS name or IP address every certificate names (repeat; default: none beyond "
                        "loopback, which is always named)")
    p.add_argument("--days", type=int, default=365,
                   help="validity of new certificates (and of a new CA), days (default 365)")
    p.set_defaults(func=run)


def parse_entry(text: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """"NAME:ROLE[+ROLE][@HOST[,HOST]]" -> (name, roles, hosts).

    Raises:
        ValueError: naming the entry, for a missing part, an unknown role, or a name that is
            not a plain file name.
    """
    spec, at, hosts = text.partition("@")
    if at and not all(hosts.split(",")):
        raise ValueError(f"{text!r}: an empty host after '@' (give HOST[,HOST], or leave out the '@')")
    name, sep, roles = spec.partition(":")
    if not sep or not name or not roles:
        raise ValueError(f"{text!r}: expected NAME:ROLE[+ROLE][@HOST[,HOST]]")
    if not all(c.isalnum() or c in "-_." for c in name) or name.startswith(".") or name in ("ca", "ca-key"):
        raise ValueError(f"{text!r}: NAME must be a plain file name other than ca (letters, digits, - _ .)")
    unknown = [r for r in roles.split("+") if r not in ROLES]
    if unknown:
        raise ValueError(f"{text!r}: unknown role {unknown[0]!r}; roles: {', '.join(ROLES)}")
    names = tuple(h for h in hosts.split(",") if h)
    bad = [h for h in names if not is_host(h)]
    if bad:
        raise ValueError(f"{text!r}: host {bad[0]!r} is neither an IP address nor a DNS name (ASCII letters, "
                         "digits, - and .; an internationalised name in its xn-- form)")
    return name, tuple(roles.split("+")), names


def is_host(text: str) -> bool:
    """Whether `text` can be a certificate's IP or DNS subject alternative name."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return len(text) <= 253 and _DNS_NAME.fullmatch(text) is not None


def _clash(entries: list[str], parsed: list[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> str | None:
    """Why two entries' files would overwrite each other (NAME.pem, NAME-key.pem: "a-key"'s
    certificate is "a"'s key), or None."""
    owner: dict[str, str] = {}
    for text, (name, _, _) in zip(entries, parsed):
        for file in (f"{name}.pem", f"{name}-key.pem"):
            if file in owner:
                return f"{text!r}: its {file} would overwrite a file of {owner[file]!r}"
            owner[file] = text
    return None


def run(args: argparse.Namespace) -> int:
    from common.certs import LOOPBACK, LocalCa
    try:
        entries = [parse_entry(e) for e in args.processes]
    except ValueError as exc:
        print(f"tandem certs: {exc}", file=sys.stderr)
        return 2
    problem = _clash(args.processes, entries)
    problem = problem or next((f"--host {h!r} is neither an IP address nor a DNS name" for h in args.host
                               if not is_host(h)), None)
    if not 1 <= args.days <= MAX_DAYS:
        problem = problem or f"--days must be between 1 and {MAX_DAYS}, got {args.days}"
    if problem:
        print(f"tandem certs: {problem}", file=sys.stderr)
        return 2
    try:
        ca = LocalCa(args.folder, name="tandem cluster CA", days=args.days, reuse=True)
    except ValueError as exc:  # the CA there cannot be used: nothing is issued
        print(f"tandem certs: {exc}", file=sys.stderr)
        return 2
    for name, roles, hosts in entries:
        names = tuple(dict.fromkeys((*LOOPBACK, *args.host, *hosts)))
        files = ca.issue(name, roles, names)
        print(f"{files.cert} (key {files.key}): roles {'+'.join(roles)}, hosts {', '.join(names)}")
    print(f"CA: {ca.ca_path} (give it to every process as --tls-ca; keep {ca.folder / 'ca-key.pem'} safe)")
    return 0
