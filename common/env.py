"""Environment variables: every CLI flag `--some-flag` has `TANDEM_SOME_FLAG` as its default.

A variable that is set but does not parse fails loudly, naming the variable.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")
PREFIX = "TANDEM_"


def env_name(flag: str) -> str:
    """'--block-size' -> 'TANDEM_BLOCK_SIZE'."""
    return PREFIX + flag.lstrip("-").replace("-", "_").upper()


def env_default(flag: str, default: T, parse: Callable[[str], T] | None = None) -> T:
    """The value of the flag's variable if set, else `default`.

    Raises:
        ValueError: the variable is set to a value `parse` rejects (message names it).
    """
    raw = os.environ.get(env_name(flag))
    if raw is None:
        return default
    parse = parse or type(default)  # type: ignore[assignment]
    try:
        return parse(raw)  # type: ignore[misc]
    except ValueError as exc:
        raise ValueError(f"{env_name(flag)}={raw!r}: {exc}") from None
