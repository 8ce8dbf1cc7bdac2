"""The effective configuration of one subcommand: flag > TANDEM_* variable > TOML file > default.

The TOML file (`--config PATH` or TANDEM_CONFIG) has one table per subcommand and a shared one
for both kinds of worker; a key is an option's name (the dataclass field, e.g. `drain_timeout_s`
for `--drain-timeout`, as `tandem config show` prints it):

    log_level = "info"          # top level: applies to every subcommand that has the option
    etcd = "10.0.0.5:2379"

    [router]                    # `tandem router` only
    port = 50051

    [worker]                    # `tandem prefill` and `tandem decode` (and `tandem tokenize`'s model)
    num_blocks = 4096

    [decode]                    # `tandem decode` only (wins over [worker] and the top level)
    max_running = 64

A key that no subcommand knows, a table that is not a subcommand, or a value of the wrong type
is an error naming the file and the key (ConfigError), before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from dataclasses import dataclass
from typing import Any

from cli.flags import Option, options_of, parser_for
from common.env import CONFIG_VAR, read_env

# shared table -> the subcommands it applies to (`tandem tokenize`: the workers' model)
SHARED = {"worker": ("prefill", "decode", "tokenize")}
TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
              list: "an array of strings"}


class ConfigError(ValueError):
    """A config file, TANDEM_* variable or value that cannot be used; the message names it."""


@dataclass(frozen=True)
class Resolved:
    value: Any
    source: str  # "default" | "env TANDEM_X" | "file PATH:table.key" | "flag --x"


@dataclass(frozen=True)
class Schema:
    """Every option the config file may set: top-level ones and each subcommand's."""

    top: dict[str, Option]
    commands: dict[str, dict[str, Option]]

    @classmethod
    def of(cls, parser: argparse.ArgumentParser) -> Schema:
        commands = {name: {o.name: o for o in options_of(p)} for name, p in subparsers(parser).items()}
        return cls({o.name: o for o in options_of(parser)}, {n: o for n, o in commands.items() if o})

    def tables(self) -> dict[str, dict[str, Option]]:
        """Table name -> the options it may hold (shared tables: those of all their subcommands)."""
        out = dict(self.commands)
        for table, members in SHARED.items():
            out[table] = {k: v for m in members for k, v in self.commands.get(m, {}).items()}
        return out

    def anywhere(self) -> dict[str, Option]:
        """Options a top-level key may name: the top level's and any subcommand's."""
        out = dict(self.top)
        for opts in self.commands.values():
            for k, v in opts.items():
                out.setdefault(k, v)
        return out


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def config_path(args: argparse.Namespace) -> tuple[str | None, str]:
    """(path of the config file or None, where it came from: 'flag --config' / 'env TANDEM_CONFIG')."""
    if getattr(args, "config", None):
        return args.config, "flag --config"
    path = os.environ.get(CONFIG_VAR)
    return (path, f"env {CONFIG_VAR}") if path else (None, "")


def _check(value: Any, opt: Option, where: str) -> Any:
    kind = opt.kind
    if kind is list:  # one string stands for a list of one
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    elif kind in (int, float):  # TOML true is not a number; an integer is a fine float
        ok = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{where}: expected {TYPE_NAMES.get(kind, kind.__name__)} "
                          f"(as for {opt.flag}), got {type(value).__name__} {value!r}")
    if kind is float:
        return float(value)
    if kind is list and isinstance(value, str):
        return [value]
    return value


def _unknown(where: str, key: str, known: list[str], what: str = "key",
             elsewhere: list[str] = ()) -> ConfigError:
    """An unknown name: `elsewhere` lists the tables that do have it (a key in the wrong table),
    else the closest known name is suggested."""
    if elsewhere:
        hint = f"; it is an option of {', '.join(f'[{t}]' for t in elsewhere)}"
    else:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where}: unknown {what} {key!r}{hint}")


def _read(path: str) -> dict[str, Any]:
    """The TOML file's tables and keys, unchecked. Raises ConfigError (unreadable, syntax)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def load_file(path: str, schema: Schema) -> dict[str, Any]:
    """Read and check the whole file (not only the part the running subcommand uses).

    Returns: {key: value} for the top level and {table: {key: value}} for tables, values
    converted to the options' kinds (an integer for a float option becomes a float).
    Raises:
        ConfigError: missing or unreadable file, TOML syntax, unknown table or key, wrong type.
    """
    raw = _read(path)
    tables, anywhere = schema.tables(), schema.anywhere()
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in tables:
                raise _unknown(f"config file {path}", key, list(tables), what="table")
            out[key] = {}
            for k, v in value.items():
                if k not in tables[key]:
                    raise _unknown(f"config file {path}: [{key}]", k, list(tables[key]),
                                   elsewhere=[t for t, members in tables.items() if k in members])
                out[key][k] = _check(v, tables[key][k], f"config file {path}: [{key}] {k}")
        elif key in anywhere:
            out[key] = _check(value, anywhere[key], f"config file {path}: {key}")
        elif key in tables:
            raise ConfigError(f"config file {path}: {key!r} is a table of options: write [{key}] and its keys "
                              "under it")
        else:
            raise _unknown(f"config file {path}", key, list(anywhere) + list(tables))
    return out


def own_values(path: str, command: str, options: list[Option]) -> dict[str, Any]:
    """`load_file`'s result restricted to `command`'s options, read without the other
    subcommands' schema (which a torch-free process such as `python -m cli.health` lacks): the
    top level's keys and those of `command`'s own table that name one of `options`, each
    type-checked; other keys and tables are not looked at.

    Raises:
        ConfigError: missing or unreadable file, TOML syntax, a wrong type for one of these keys.
    """
    raw = _read(path)
    known = {o.name: o for o in options}
    out: dict[str, Any] = {k: _check(v, known[k], f"config file {path}: {k}")
                           for k, v in raw.items() if k in known and not isinstance(v, dict)}
    table = raw.get(command)
    if isinstance(table, dict):
        out[command] = {k: _check(v, known[k], f"config file {path}: [{command}] {k}")
                        for k, v in table.items() if k in known}
    return out


def _from_file(data: dict[str, Any], command: str, name: str) -> tuple[Any, str] | None:
    tables = [command] if command else []
    tables += [t for t, members in SHARED.items() if command in members]
    for table in tables:
        if name in data.get(table, {}):
            return data[table][name], f"{table}.{name}"
    if name in data and not isinstance(data[name], dict):
        return data[name], name
    return None


def resolve(command: str, options: list[Option], args: argparse.Namespace, path: str | None,
            data: dict[str, Any]) -> dict[str, Resolved]:
    """The value and source of each option of `command` ("" for the top-level options).

    Raises:
        ConfigError: a TANDEM_* variable that does not parse (named).
    """
    out: dict[str, Resolved] = {}
    for opt in options:
        if hasattr(args, opt.name):
            out[opt.name] = Resolved(getattr(args, opt.name), f"flag {opt.flag}")
            continue
        try:
            value = read_env(opt.env, parser_for(opt.kind))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if value is not None:
            out[opt.name] = Resolved(value, f"env {opt.env}")
        elif (found := _from_file(data, command, opt.name)) is not None:
            out[opt.name] = Resolved(found[0], f"file {path}:{found[1]}")
        else:
            out[opt.name] = Resolved(opt.default, "default")
    return out


def effective(parser: argparse.ArgumentParser, args: argparse.Namespace,
              command: str) -> tuple[dict[str, Resolved], dict[str, Resolved], str | None]:
    """(top-level options, `command`'s options, config file path) as they apply to this run."""
    path, _ = config_path(args)
    schema = Schema.of(parser)
    data = load_file(path, schema) if path else {}
    top = resolve("", options_of(parser), args, path, data)
    sub = subparsers(parser).get(command)
    mine = resolve(command, options_of(sub), args, path, data) if sub is not None else {}
    return top, mine, path


def apply(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill every option of the chosen subcommand into `args` (in place).

    Raises:
        ConfigError: see load_file and resolve.
    """
    top, mine, path = effective(parser, args, args.command)
    for name, r in {**top, **mine}.items():
        setattr(args, name, r.value)
    if path:
        args.config = path
    flags = {o.name: o.flag for o in options_of(parser)}
    sub = subparsers(parser).get(args.command)
    flags.update({o.name: o.flag for o in options_of(sub)} if sub is not None else {})
    resolved = {flags[n]: r.source for n, r in {**top, **mine}.items() if n in flags}
    args.set_by = {f: src for f, src in resolved.items() if src.startswith(("env ", "file "))}
    args.given = {f for f, src in resolved.items() if src.startswith("flag ")}  # on the command line

