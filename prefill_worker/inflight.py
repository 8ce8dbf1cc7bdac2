"""Prompts that share a prefix with one being prefilled now wait for it instead of computing it again.

The prefix cache holds a prompt's blocks only once its prefill is done (`KvPool.commit_prompt`),
so prompts with a common prefix arriving together — a burst of requests with one system
prompt, the turns of many conversations at once — each compute that prefix in full: at 64
concurrent 1K prompts in 8 groups sharing 512 tokens, 44 % of the prefill work is repeated.
SGLang's scheduler meets the same case by holding back waiting requests whose prefix matches one
already scheduled in the batch ("in-batch prefix caching"). Here a prompt whose next uncached
blocks are being computed for another prompt, and whose shared run covers at least as many
tokens as it would still compute on its own (so waiting at least halves its work), gives its
blocks back, waits until that prompt's blocks are cached (or its prefill ends otherwise), and
allocates again, now finding them in the prefix cache. It does not wait for a prompt with more
tokens to compute than it has itself (a short prompt that a long one starts with would wait for
the whole long prefill), nor for its last token's block (never taken from the cache). The wait
is bounded: at most half the call's remaining deadline and `MAX_WAIT_S`; past it the prompt
computes everything itself.

Only the prefill worker waits: a decode worker's blocks are a transfer's destination, all fresh.
Block hashes chain their prefix (engine/block_pool.py), so an in-flight hash at position i means
the same tokens up to i.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from engine.kv_pool import PromptBlocks

MAX_WAIT_S = 10.0


@dataclass(eq=False)
class _Claim:
    """One prompt's announced blocks: set when it is done; the tokens it computes."""

    tokens: int
    event: asyncio.Event = field(default_factory=asyncio.Event)


class InflightPrefixes:
    """Block hashes of prompts being prefilled now (single-threaded: the event loop's)."""

    def __init__(self) -> None:
        self._by_hash: dict[int, _Claim] = {}  # block hash -> the prompt computing it now

    def __len__(self) -> int:
        return len(self._by_hash)

    def shared(self, prompt: PromptBlocks, prompt_tokens: int, block_size: int) -> tuple[int, _Claim | None]:
        """(blocks right after the prompt's cached prefix that another prompt computes now and
        that this one could take from the cache, the claim of the one computing the last of
        them). A prompt never takes its last token's block from the cache (KvPool.allocate_prompt
        leaves at least one token to compute), so that block is not counted."""
        usable = (prompt_tokens - 1) // block_size - prompt.num_cached_blocks
        n, claim = 0, None
        for h in prompt.hashes[prompt.num_cached_blocks:prompt.num_cached_blocks + max(0, usable)]:
            c = self._by_hash.get(h)
            if c is None:
                break
            n, claim = n + 1, c
        return n, claim

    def should_wait(self, prompt: PromptBlocks, prompt_tokens: int, block_size: int) -> asyncio.Event | None:
        """The event to wait for, or None (compute now). It waits when the in-flight shared run
        is at least what the prompt would compute after it (waiting at least halves its work),
        and the prompt computing that run has no more tokens to compute than this one would on
        its own (so the wait is not longer than computing: a short prompt does not wait for a
        long one that merely starts with it)."""
        n, claim = self.shared(prompt, prompt_tokens, block_size)
        if claim is None:
            return None
        alone = prompt_tokens - prompt.num_cached_blocks * block_size
        own = alone - n * block_size
        return claim.event if n * block_size >= own and claim.tokens <= alone else None

    def announce(self, prompt: PromptBlocks, prompt_tokens: int, block_size: int) -> Callable[[], None]:
        """Announce the prompt's uncached full blocks as being computed (hashes another prompt
        already announced stay that prompt's). Returns `done` (idempotent): call it once the
        blocks are in the prefix cache, and in any case when the prefill ends, to wake the
        waiters."""
        claim = _Claim(prompt_tokens - prompt.num_cached_blocks * block_size)
        mine = [h for h in prompt.hashes[prompt.num_cached_blocks:] if h not in self._by_hash]
        for h in mine:
            self._by_hash[h] = claim
        return lambda: self._release(mine, claim)

    def _release(self, hashes: list[int], claim: _Claim) -> None:
        for h in hashes:
            if self._by_hash.get(h) is claim:
                del self._by_hash[h]
        claim.event.set()


async def wait_for(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to timeout_s (capped at MAX_WAIT_S) for event; False when the time ran out."""
    try:
        await asyncio.wait_for(event.wait(), max(0.0, min(timeout_s, MAX_WAIT_S)))
        return True
    except (TimeoutError, asyncio.TimeoutError):
        return False
