"""Environment variables: every CLI flag `--some-flag` has `TANDEM_SOME_FLAG`.

A variable that is set but does not parse fails loudly, naming the variable. The precedence
of variables among flags, the config file and defaults is cli/config.py's.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")
PREFIX = "TANDEM_"
CONFIG_VAR = "TANDEM_CONFIG"  # path of the TOML config file (`--config`)
# Test-only: a worker started with this set takes it as its instance id instead of a random one,
# so a test can restart a worker under the same identity (a new incarnation; issue 20).
TEST_INSTANCE_ID_VAR = "TANDEM_TEST_INSTANCE_ID"
# Test-only: a prefill worker started with this set to N stops itself (SIGSTOP) once, right
# after posting its N-th KV write and before that write starts: stopped mid-transfer (issue 20).
TEST_STOP_AFTER_WRITES_VAR = "TANDEM_TEST_STOP_AFTER_WRITES"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(flag: str) -> str:
    """'--block-size' -> 'TANDEM_BLOCK_SIZE'."""
    return PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(raw: str) -> bool:
    """'1', 'true', 'yes', 'on' / '0', 'false', 'no', 'off' (any case).

    Raises:
        ValueError: anything else.
    """
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(sorted(_TRUE | _FALSE))}")


def read_env(name: str, parse: Callable[[str], T]) -> T | None:
    """The parsed value of variable `name`, or None when it is not set.

    Raises:
        ValueError: the variable is set to a value `parse` rejects (message names it).
    """
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def env_default(flag: str, default: T, parse: Callable[[str], T] | None = None) -> T:
    """The value of the flag's variable if set, else `default`.

    Raises:
        ValueError: the variable is set to a value `parse` rejects (message names it).
    """
    value = read_env(env_name(flag), parse or type(default))  # type: ignore[arg-type]
    return default if value is None else value
