"""How long a running stream may stay silent before its decode worker counts as failed.

The rule (issue 20: "no token for N × the expected ITL"): for a stream on worker w,

    stall_s(w) = max(floor_s, factor × itl(w) × tokens_per_message(w))

where itl(w) is an exponentially weighted mean of the inter-token latency the router has seen
on w's running streams (every stream of w feeds it: one step of a worker serves all its
streams), and tokens_per_message(w) one of the tokens its messages carry (a decode worker with
`--stream-interval N` sends N per message, so its streams are silent N × itl between messages
by design). floor_s is `--token-stall-timeout` (0 turns the rule off), factor is
`--token-stall-itl-factor` (0 = the floor alone). A worker with no sample yet gets the floor.
The floor keeps a fast worker's ordinary silences (a request retracted for lack of KV blocks
waiting to resume, another request's long local prefill, a loaded host) from counting as
failures; the factor lets a worker that is
slow for good (large batch, big model) take proportionally longer without being evicted.

A stalled worker feeds no samples (nothing arrives), so its estimate does not grow while it is
silent; a gap that does end feeds both means once, as its message's tokens and seconds per token.
"""

from __future__ import annotations

ALPHA = 0.1  # weight of one new sample: about the last 10 to 20 tokens of the worker's streams


class StallRule:
    """Per-worker ITL estimates and the stall timeout they give (see the module docstring).

    Args:
        floor_s: --token-stall-timeout, seconds (>= 0; 0 = no stall timeout at all).
        factor: --token-stall-itl-factor (>= 0; 0 = floor_s alone).
    Raises:
        ValueError: a negative value (naming the flag).
    """

    def __init__(self, floor_s: float, factor: float) -> None:
        if floor_s < 0:
            raise ValueError(f"--token-stall-timeout must be >= 0 seconds (0 = off), got {floor_s}")
        if factor < 0:
            raise ValueError(f"--token-stall-itl-factor must be >= 0 (0 = the floor alone), got {factor}")
        self.floor_s, self.factor = floor_s, factor
        self._itl: dict[str, float] = {}  # instance id -> EWMA of seconds per token
        self._tpm: dict[str, float] = {}  # instance id -> EWMA of tokens per message

    def observe(self, instance_id: str, gap_s: float, tokens: int) -> None:
        """A message of `tokens` tokens arrived `gap_s` seconds after the stream's previous one."""
        if tokens <= 0 or gap_s < 0:
            return
        per_token = gap_s / tokens
        old = self._itl.get(instance_id)
        self._itl[instance_id] = per_token if old is None else old + ALPHA * (per_token - old)
        old = self._tpm.get(instance_id)
        self._tpm[instance_id] = tokens if old is None else old + ALPHA * (tokens - old)

    def itl_s(self, instance_id: str) -> float | None:
        """The worker's ITL estimate in seconds (None: no sample yet)."""
        return self._itl.get(instance_id)

    def timeout_s(self, instance_id: str) -> float | None:
        """Seconds a running stream on the worker may go without a message; None = no bound."""
        if not self.floor_s:
            return None
        itl = self._itl.get(instance_id)
        if itl is None:
            return self.floor_s
        return max(self.floor_s, self.factor * itl * max(1.0, self._tpm.get(instance_id, 1.0)))

    def forget_except(self, present: set[str]) -> None:
        """Drop the estimates of workers not in `present` (they left discovery)."""
        for wid in [w for w in self._itl if w not in present]:
            del self._itl[wid]
            self._tpm.pop(wid, None)
