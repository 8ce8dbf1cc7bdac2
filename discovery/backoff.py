"""Exponential back-off with jitter for etcd retries."""

from __future__ import annotations

import random


class Backoff:
    """Delays (seconds) growing `multiplier`-fold from `initial` up to `maximum`.

    Each delay is scaled by a random factor in [1 - jitter, 1 + jitter] so that many processes
    that lost etcd at the same moment do not retry in lockstep.
    """

    def __init__(
        self,
        initial: float = 0.1,
        maximum: float = 5.0,
        multiplier: float = 2.0,
        jitter: float = 0.2,
    ) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"back-off needs 0 < initial <= maximum, got {initial}, {maximum}")
        if not 0 <= jitter < 1:
            raise ValueError(f"back-off jitter must be in [0, 1), got {jitter}")
        self._initial = initial
        self._maximum = maximum
        self._multiplier = multiplier
        self._jitter = jitter
        self._next = initial

    def next(self) -> float:
        """The next delay in seconds (and grow the following one)."""
        delay = self._next
        self._next = min(self._maximum, self._next * self._multiplier)
        return delay * random.uniform(1 - self._jitter, 1 + self._jitter)

    def reset(self) -> None:
        """Start again from `initial` (after a success)."""
        self._next = self._initial
