"""Stop strings over streamed text: holds back just enough text to catch a match that
spans two deltas, and cuts the output before the first match."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to send now, whether a stop string matched)."""
        self._pending += delta
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._pending = self._pending[: min(hits)], ""
            return out, True
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
