"""The router's own account of the load it has placed on each worker.

Every replica counts only what it routed itself (replicas do not coordinate; DESIGN.md
section 4): in-flight requests, active decode blocks (prompt blocks plus one block per
`block_size` generated tokens), and queued prefill tokens (uncached prompt tokens sent to a
prefill worker and not yet answered with a first token).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class RequestLoad:
    """What one routed request adds; released exactly once through LoadTracker."""

    decode_id: str
    prefill_id: str | None
    decode_blocks: int
    prefill_tokens: int
    prefill_done: bool = False
    released: bool = False


class LoadTracker:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        self.active_blocks: defaultdict[str, int] = defaultdict(int)  # decode workers
        self.prefill_tokens: defaultdict[str, int] = defaultdict(int)  # prefill workers

    def start(self, decode_id: str, prefill_id: str | None, prompt_tokens: int, uncached_tokens: int) -> RequestLoad:
        load = RequestLoad(decode_id, prefill_id, -(-prompt_tokens // self.block_size),
                           uncached_tokens if prefill_id else 0)
        self.in_flight[decode_id] += 1
        self.active_blocks[decode_id] += load.decode_blocks
        if prefill_id:
            self.in_flight[prefill_id] += 1
            self.prefill_tokens[prefill_id] += load.prefill_tokens
        return load

    def prefill_finished(self, load: RequestLoad) -> None:
        if load.prefill_id and not load.prefill_done:
            load.prefill_done = True
            self.in_flight[load.prefill_id] -= 1
            self.prefill_tokens[load.prefill_id] -= load.prefill_tokens

    def grow(self, load: RequestLoad, generated_before: int, generated_now: int) -> None:
        """Account one more decode block for every block_size tokens generated."""
        added = generated_now // self.block_size - generated_before // self.block_size
        if added and not load.released:
            load.decode_blocks += added
            self.active_blocks[load.decode_id] += added

    def finish(self, load: RequestLoad) -> None:
        if load.released:
            return
        self.prefill_finished(load)
        load.released = True
        self.in_flight[load.decode_id] -= 1
        self.active_blocks[load.decode_id] -= load.decode_blocks
