"""The TLS options (common/tls.py): flags, TANDEM_* variables and TOML keys on every process,
their validation, and `tandem up`'s certificates (common/certs.py) on its children's command lines."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cryptography import x509

from cli import config
from cli.cluster import LocalCluster
from cli.main import build_parser
from common.certs import LocalCa
from common.tls import INSTANCE_URI, ROLE_URI, TlsFiles
from mocker.fleet import MockerOptions
from router.main import RouterOptions
from worker.host import WorkerOptions


@pytest.fixture(autouse=True)
def no_tandem_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("command", ["router", "prefill", "decode", "mocker"])
def test_every_process_takes_tls_files_from_flag_env_and_file(tmp_path, monkeypatch, command):
    path = tmp_path / "tandem.toml"
    path.write_text('tls_ca = "/etc/tandem/ca.pem"\n')
    monkeypatch.setenv("TANDEM_TLS_KEY", "/etc/tandem/key.pem")
    parser = build_parser()
    args, rest = parser.parse_known_args([command, "--config", str(path), "--tls-cert", "/etc/tandem/cert.pem"])
    assert not rest
    _, mine, _ = config.effective(parser, args, command)
    got = {k: (mine[k].value, mine[k].source.split(":")[0]) for k in ("tls_cert", "tls_key", "tls_ca")}
    assert got == {"tls_cert": ("/etc/tandem/cert.pem", "flag --tls-cert"),
                   "tls_key": ("/etc/tandem/key.pem", "env TANDEM_TLS_KEY"),
                   "tls_ca": ("/etc/tandem/ca.pem", f"file {path}")}


@pytest.mark.parametrize("cls,extra", [(WorkerOptions, {}), (RouterOptions, {"etcd": "127.0.0.1:2379"}),
                                       (MockerOptions, {})])
@pytest.mark.parametrize("given,message", [
    ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "need --tls-ca"),
    ({"tls_ca": "ca.pem"}, "--tls-ca needs --tls-cert and --tls-key"),
])
def test_some_but_not_all_tls_flags_is_an_error_naming_them(cls, extra, given, message):
    with pytest.raises(ValueError, match=message):
        cls(**extra, **given)


def test_a_frontend_client_may_give_the_ca_alone_and_unreadable_files_name_the_flag(tmp_path):
    assert TlsFiles(ca="ca.pem", client=True).enabled
    with pytest.raises(ValueError, match="--tls-ca .*missing.pem"):
        TlsFiles(ca=str(tmp_path / "missing.pem"), client=True).load()
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-ca .*: not a PEM file"):
        TlsFiles(ca=str(tmp_path / "junk.pem"), client=True).load()


def test_issued_certificates_name_roles_and_loopback_and_chain_to_the_ca(tmp_path):
    ca = LocalCa(tmp_path)
    files = ca.issue("mocker", ("decode", "prefill"))
    cert = x509.load_pem_x509_certificate(Path(files.cert).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [ROLE_URI + "decode", ROLE_URI + "prefill",
                                                                       INSTANCE_URI + "mocker"]
    assert files.load().instance == "mocker"  # the instance id a worker holding it registers under
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert cert.issuer == x509.load_pem_x509_certificate(Path(files.ca).read_bytes()).subject
    assert oct(os.stat(files.key).st_mode & 0o777) == "0o600"


def test_tandem_up_gives_every_child_its_own_certificate(monkeypatch, tmp_path):
    seen: dict[str, list[str]] = {}

    class FakePopen:  # records the command line instead of starting a process
        def __init__(self, cmd, **kwargs) -> None:
            seen[cmd[3]] = cmd

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    c = LocalCluster(log_dir=str(tmp_path), etcd="127.0.0.1:1")
    c.ca = LocalCa(tmp_path / "tls")  # what start() makes
    for role in ("router", "prefill", "decode", "mocker"):
        c.spawn(role, role)
    certs = {r: seen[r][seen[r].index("--tls-cert") + 1] for r in seen}
    assert len(set(certs.values())) == 4 and all("--tls-ca" in cmd for cmd in seen.values())
    (tmp_path / "plain").mkdir()
    insecure = LocalCluster(log_dir=str(tmp_path / "plain"), etcd="127.0.0.1:1", tls=False)
    monkeypatch.setenv("TANDEM_TLS_CA", "/elsewhere/ca.pem")
    insecure.spawn("router", "router")
    assert "--tls-cert" not in seen["router"]


def test_tandem_up_has_an_insecure_switch():
    parser = build_parser()
    args, _ = parser.parse_known_args(["up", "--insecure"])
    assert args.insecure is True


def test_local_clients_find_the_ca_of_tandem_up(tmp_path):
    """A client of a loopback router whose port has a `tandem up` CA file uses it without
    --tls-ca; other addresses, or no file, stay plaintext; --tls-ca wins; a file its writer no
    longer holds (a killed `tandem up`) is not used."""
    import argparse

    from cli.client import LocalCaFile, client_credentials, local_ca_file
    from common.certs import LocalCa
    ca = LocalCa(tmp_path / "tls")
    port = 1  # no real cluster serves port 1
    held = LocalCaFile(port, Path(ca.ca_path).read_bytes())
    path = held.path
    try:
        def args(router, tls_ca=""):
            return argparse.Namespace(router=router, tls_ca=tls_ca, tls_cert="", tls_key="")
        assert path == local_ca_file(port) and path.read_bytes() == Path(ca.ca_path).read_bytes()
        assert client_credentials(args(f"127.0.0.1:{port}")) is not None
        assert client_credentials(args(f"10.1.2.3:{port}")) is None  # not this machine's cluster
        assert client_credentials(args("127.0.0.1:2")) is None  # no cluster of ours there
        assert client_credentials(args("127.0.0.1:2", tls_ca=ca.ca_path)) is not None
        path.chmod(0o666)  # writable by others: it could have been planted, so it is not trusted
        assert client_credentials(args(f"127.0.0.1:{port}")) is None
        path.chmod(0o644)
        os.close(held._fd)  # what a killed writer leaves: the file, no lock
        held._fd = -1
        assert path.exists() and client_credentials(args(f"127.0.0.1:{port}")) is None
    finally:
        held.close()
        path.unlink(missing_ok=True)
    assert client_credentials(args(f"127.0.0.1:{port}")) is None


def test_one_tandem_up_per_port_and_each_removes_only_its_own_ca_file(tmp_path):
    from cli.client import LocalCaFile, PortBusy, PortLock, local_ca_for
    from common.certs import LocalCa
    port = 2  # no real cluster serves port 2
    first = PortLock(port)
    try:
        with pytest.raises(PortBusy, match="port 2"):
            PortLock(port)  # a second tandem up on the port is refused before it starts anything
    finally:
        first.close()
    assert not first.path.exists()  # no lock file left behind for each port ever used
    # a claimant that opened the file before the holder let go (and removed it) takes its lock on a
    # removed file: it must notice and claim the path's file of now, not hold a lock nobody sees
    held = PortLock(port)
    import fcntl
    import os
    stale = os.open(held.path, os.O_RDWR)
    held.close()
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (what a racing __init__ would get)
    again = PortLock(port)  # a new file: not blocked by the stale inode's lock
    try:
        with pytest.raises(PortBusy):
            PortLock(port)
    finally:
        again.close()
        os.close(stale)
    # a lock whose file someone removed while it was held lets go without removing the next one's
    first = PortLock(port)
    first.path.unlink()
    second = PortLock(port)  # (a new file: the removed one's lock is not seen)
    first.close()
    assert second.path.exists()
    with pytest.raises(PortBusy):
        PortLock(port)
    second.close()
    PortLock(port).close()  # free again once the first is gone
    # a cluster stopping late must not remove the file of the cluster after it
    old = LocalCaFile(port, Path(LocalCa(tmp_path / "a").ca_path).read_bytes())
    new = LocalCaFile(port, Path(LocalCa(tmp_path / "b").ca_path).read_bytes())
    try:
        old.close()
        assert new.path.exists() and local_ca_for(f"127.0.0.1:{port}") == str(new.path)
    finally:
        new.close()
    assert not new.path.exists()


def test_a_process_certificate_given_as_the_ca_is_refused_naming_the_flag(tmp_path):
    files = LocalCa(tmp_path).issue("router-0", ("router",))
    with pytest.raises(ValueError, match=r"--tls-ca .*router-0.pem: holds no CA certificate"):
        TlsFiles("", "", files.cert, client=True).load()
    assert TlsFiles("", "", files.ca, client=True).load().ca  # the CA's own file is fine


def test_a_port_lock_taken_on_a_file_removed_meanwhile_is_taken_again(monkeypatch):
    import fcntl
    import os
    from cli import client
    port = 3  # no real cluster serves port 3
    real, calls = fcntl.flock, []

    def flock(fd, op):  # the holder lets go (removes the file) between this claimant's open and flock
        calls.append(fd)
        if len(calls) == 1:
            path = client.local_ca_file(port).with_name(f"up-{port}.lock")
            path.unlink()
            path.touch(mode=0o600)  # and a third claimant's file appears at the path
        return real(fd, op)

    monkeypatch.setattr(client.fcntl, "flock", flock)
    lock = client.PortLock(port)
    try:
        assert len(calls) == 2  # the first lock was on the removed file: taken again on the new one
        mine, there = os.fstat(lock._fd), os.stat(lock.path)
        assert (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
    finally:
        lock.close()
