"""Log lines at a bounded rate: a failure that repeats (a dead peer, a full pool) must not
flood the log. Suppressed lines are counted and reported with the next one let through."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most one line per `interval_s` seconds per key."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        skipped = self._suppressed.pop(key, 0)
        if skipped:
            msg += f" ({skipped} similar lines suppressed)"
        self._log.warning(msg, *args)
