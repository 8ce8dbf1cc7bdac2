"""`tandem config show [SUBCOMMAND] [FLAGS...] [--config PATH]`: the effective configuration,
one line per option with where its value came from, printed as TOML (a valid config file).

    tandem config show decode --config /etc/tandem/tandem.toml --port 50062
    # config file: /etc/tandem/tandem.toml (flag --config)
    log_level = "info"                 # default

    [decode]
    etcd = "10.0.0.5:2379"             # file /etc/tandem/tandem.toml:etcd
    port = 50062                       # flag --port
    num_blocks = 8192                  # env TANDEM_NUM_BLOCKS
    ...

Flags after SUBCOMMAND are that subcommand's own, so the output is what `tandem SUBCOMMAND
FLAGS...` would run with. Values that command would refuse at start (its options' own checks,
e.g. `--stream-interval must be >= 1`) are named in a comment line and on stderr, and the exit
status is then 2 when SUBCOMMAND was given; a required value the defaults lack as well (the
router's --etcd, which `tandem up` or the unit's command line gives) is not reported.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from cli.config import ConfigError, Resolved, Schema, config_path, load_file, resolve, subparsers
from cli.flags import OTHER_ROLE_ONLY, add_argument, options_of, refuse_other_role



def _under_up(command: str, problem: str) -> str:
    """A note for a refusal that `tandem up` can make moot: it passes some of its processes' flags
    itself (a [router] http_host with the router's own --http-port off is fine for a file meant
    for tandem up, which turns the API on unless given --http-port -1)."""
    if command not in ("router", "prefill", "decode", "mocker"):
        return ""
    from cli.main import UP_GIVES
    unless = {"--http-port": "its --http-port is -1", "--metrics-port": "it runs with --no-metrics"}
    passed = [f for f in (*UP_GIVES, *(("--http-port",) if command == "router" else ()))
              if re.search(re.escape(f) + r"\b", problem) and not (command == "mocker" and f == "--metrics-port")]
    if not passed:
        return ""
    conditions = [unless[f] for f in passed if f in unless]
    return (f" (tandem up passes {', '.join(passed)} itself: a file for tandem up is refused for this only "
            f"where {' or '.join(conditions)})" if conditions else
            f" (tandem up passes {', '.join(passed)} itself: a file for tandem up is not refused for this)")


def toml_value(value: Any) -> str | None:
    """value as a TOML literal; None (an unset option) has none."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string literal is a TOML basic string


def render(table: str, resolved: dict[str, Resolved]) -> list[str]:
    lines = [f"[{table}]"] if table else []
    rows = []
    for name, r in resolved.items():
        literal = toml_value(r.value)
        rows.append((f"{name} = {literal}" if literal is not None else f"# {name} = (unset)", r.source))
    width = max((len(left) for left, _ in rows), default=0)
    lines += [f"{left:<{width}}  # {source}" for left, source in rows]
    return lines


def show(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str], out=None) -> int:
    """Print the effective configuration of args.target (every subcommand when None).

    Raises:
        ConfigError: as cli.config.load_file / resolve, or an unknown subcommand.
    """
    schema = Schema.of(parser)
    if args.target is None and extra and not extra[0].startswith("-"):
        # `config show --config FILE router`: argparse fills the optional positional before the
        # flag (with nothing) and leaves the subcommand over.
        args.target, extra = extra[0], extra[1:]
    if args.target is not None and args.target not in schema.commands:
        raise ConfigError(f"config show: {args.target!r} has no options; choose one of: "
                          + ", ".join(schema.commands))
    flags = argparse.Namespace()
    if args.target is not None:
        only = argparse.ArgumentParser(prog=f"tandem config show {args.target}")
        for opt in options_of(subparsers(parser)[args.target]):
            add_argument(only, opt)
        if args.target in OTHER_ROLE_ONLY:
            refuse_other_role(only, args.target)
        flags = only.parse_args(extra)
    elif extra:
        raise ConfigError(f"config show: flags {' '.join(extra)} need a subcommand before them")
    path, origin = config_path(args)
    data = load_file(path, schema) if path else {}
    lines = ["# tandem config show: precedence flag > env > file > default",
             f"# config file: {path} ({origin})" if path else "# config file: none (--config or TANDEM_CONFIG)"]
    lines += render("", resolve("", options_of(parser), args, path, data))
    refused = []
    for command in [args.target] if args.target else schema.commands:
        sub = subparsers(parser)[command]
        resolved = resolve(command, options_of(sub), flags, path, data)
        lines += ["", *render(command, resolved)]
        problem = check(command, {name: r.value for name, r in resolved.items()})
        if problem and problem == check(command, {opt.name: opt.default for opt in options_of(sub)}):
            problem = ""  # the defaults alone miss it too (the router's --etcd): given at launch, not a setting
        if problem:
            problem += _under_up(command, problem)
            lines.append(f"# tandem {command} would refuse this: {problem}")
            refused.append(f"tandem config show: [{command}] {problem}")
    print("\n".join(lines), file=out or sys.stdout)
    for line in refused:
        print(line, file=sys.stderr)
    # naming a subcommand asks whether it would start: 2 if not (the overview only notes it)
    return 2 if refused and args.target is not None else 0


def check(command: str, values: dict[str, Any]) -> str:
    """What `tandem COMMAND` would refuse at start in these values (the same checks: its options'
    dataclass), or "" when they are fine. Commands without such a dataclass: ""."""
    if command in ("decode", "prefill"):
        from worker.host import WorkerOptions as cls
    elif command == "router":
        from router.main import RouterOptions as cls
    else:
        return ""
    import dataclasses
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        cls(**{k: v for k, v in values.items() if k in names})
    except (ValueError, TypeError) as exc:
        return str(exc)
    return ""
