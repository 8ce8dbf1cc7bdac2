"""Stop strings over streamed text: holds back just the text that could begin a match
spanning two deltas (the longest end of the text that is the start of a stop string), and cuts
the output before the first match. Text that cannot begin one goes out at once, so a stream
with a long stop string, or a chat reply with its end-of-turn stop, does not lag behind."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        self.active = bool(stop)  # False: every delta passes whole (feed returns it as it is)
        self._hold = max((len(s) for s in stop), default=1) - 1  # the most that can be held
        self._firsts = frozenset(s[0] for s in stop)
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to send now, whether a stop string matched)."""
        self._pending += delta
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._pending = self._pending[: min(hits)], ""
            return out, True
        cut = self._unsafe_from()
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def _unsafe_from(self) -> int:
        """Where the pending text's end that could still begin a match starts: the smallest i
        within the last `_hold` characters where pending[i:] is the start of a stop string (it
        holds no whole one: feed looked); len(pending) when there is none."""
        p = self._pending
        for i in range(max(0, len(p) - self._hold), len(p)):
            if p[i] in self._firsts and any(s.startswith(p[i:]) for s in self._stop):
                return i
        return len(p)

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def feed_tokens(stops: StopMatcher, detok, ids: list[int], final: bool) -> tuple[str, bool, int]:
    """Feed one response's ids to detok (an IncrementalDetokenizer) and stops one token at a
    time, so a response carrying several tokens (MTP emits up to k + 1 per step) is cut right
    after the token whose text completes a stop string. Returns (text to send, stopped, number
    of ids to send). Without stop strings the response's ids go to detok at once: the same text
    (detokenized text is the same however the ids are grouped), a quarter of the decoding work
    at four tokens per response."""
    if not stops.active:
        return detok.push(ids, final=final), False, len(ids)
    if final and not ids:  # a finish without tokens: what detok held back (a character's first
        # bytes, sent as U+FFFD) still goes out, through the stop strings
        delta, stopped = stops.feed(detok.push([], final=True))
        return delta, stopped, 0
    text = ""
    for i, token in enumerate(ids):
        delta, stopped = stops.feed(detok.push([token], final=final and i == len(ids) - 1))
        text += delta
        if stopped:
            return text, True, i + 1
    return text, False, len(ids)
