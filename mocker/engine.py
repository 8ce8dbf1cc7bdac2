"""A simulated engine: the real KV pool accounting and KV events, a timing model instead of a model.

The pool is engine/kv_pool.py's `KvPool` (its tensor on torch's "meta" device, so it holds no
memory) with engine/block_pool.py's `BlockPool` — the same block hash, prefix cache, LRU
eviction and events as a real worker — and `KvEventLog` serves them to the router. The
engine performs the same pool calls in the same order as the real workers:
`allocate_prompt` on admission (reusing the cached prefix), `commit_prompt` when the prompt's
KV is complete, `grow` to prompt + generated tokens before each decode step, `free` when a
request finishes or is cancelled (decode_worker/scheduler.py, prefill_worker/service.py).

`step()` runs one engine iteration — a decode step for up to `max_running` running requests
plus at most one prefill chunk of `chunk_size` tokens (FCFS) — and returns its simulated
duration from mocker/timing.py. Nothing sleeps here: a real-time driver (mocker/driver.py) or
the offline discrete-event replay (bench/sim.py) owns the clock.

Admission control (why requests wait instead of failing): a request is admitted, FCFS, only
when the pool's free blocks (evictable cached ones included) cover its prompt plus
`max_tokens` and every admitted request's remaining growth, so a decode step never runs out
of blocks; a request larger than the whole pool is refused (`RequestTooLarge`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.block_pool import BlockId
from engine.kv_events import KvEventLog
from engine.kv_pool import KvPool, KvPoolConfig, PromptBlocks
from mocker.timing import TimingModel


class Kind(enum.Enum):
    LOCAL = "local"  # prefill and decode here (a decode worker prefilling locally, or aggregated)
    PREFILL_ONLY = "prefill"  # a prefill worker: done after the first token
    REMOTE_KV = "remote"  # a decode worker whose prompt KV comes from a prefill worker


class State(enum.Enum):
    WAITING = "waiting"  # not admitted: no blocks yet
    AWAIT_KV = "await_kv"  # REMOTE_KV: blocks allocated, waiting for the prefill worker
    PREFILL = "prefill"
    RUNNING = "running"  # decoding
    DONE = "done"


class RequestTooLarge(Exception):
    """prompt + max_tokens needs more blocks than the whole pool (RESOURCE_EXHAUSTED)."""


def output_token(step: int) -> int:
    """The simulated model's token at a generation step (no model: any fixed, valid id)."""
    return 1000 + step % 1000


@dataclass(eq=False)
class SimRequest:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    kind: Kind = Kind.LOCAL
    on_change: Callable[[SimRequest], None] | None = None  # after admission, first token, tokens, end
    state: State = State.WAITING
    prompt: PromptBlocks | None = None
    block_ids: list[BlockId] = field(default_factory=list)
    computed: int = 0  # prompt tokens whose KV is in the pool
    generated: int = 0  # tokens generated (the first one comes with the prefill)
    cached_tokens: int = 0  # prompt tokens found in this pool's prefix cache
    arrival: float = 0.0  # engine clock (simulated seconds) at submit
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def reserve_tokens(self) -> int:
        """Tokens whose blocks this request may hold at most: prompt + max_tokens (prefill-only: prompt)."""
        extra = 0 if self.kind is Kind.PREFILL_ONLY else self.max_tokens
        return len(self.token_ids) + extra


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0  # computed here
    decode_steps: int = 0
    first_tokens: int = 0
    busy_s: float = 0.0  # simulated seconds spent in iterations


class MockEngine:
    """One simulated worker's engine (single-threaded: call from one thread/loop)."""

    def __init__(self, num_blocks: int, block_size: int, hash_seed: int, timing: TimingModel,
                 chunk_size: int = 8192, max_running: int = 256) -> None:
        if chunk_size < 1 or max_running < 1:
            raise ValueError("chunk_size and max_running must be >= 1")
        self.pool = KvPool(KvPoolConfig(num_blocks=num_blocks, block_size=block_size, num_layers=1, kv_dim=1),
                           hash_seed, device="meta")
        self.events = KvEventLog(self.pool.blocks)
        self.timing = timing
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.now = 0.0  # engine clock, simulated seconds (advanced by step())
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.await_kv: list[SimRequest] = []
        self.changed: list[SimRequest] = []  # to notify; the driver flushes them when due
        self.stats = EngineStats()

    # -- requests in and out --------------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        """Queue a request (admitted FCFS when blocks allow).

        Raises:
            RequestTooLarge: it could never fit this pool.
        """
        need = self.pool.blocks_for(req.reserve_tokens)
        if need > self.pool.config.num_blocks:
            raise RequestTooLarge(f"KV pool exhausted: prompt + max_tokens need {need} blocks, the pool has "
                                  f"{self.pool.config.num_blocks}")
        req.arrival = self.now
        self.waiting.append(req)

    def kv_arrived(self, req: SimRequest, first_token_ok: bool = True) -> None:
        """REMOTE_KV: the prefill worker wrote the prompt's KV (or failed: prefill here instead)."""
        if req.state is not State.AWAIT_KV:
            return  # cancelled meanwhile
        self.await_kv.remove(req)
        if not first_token_ok:
            req.kind = Kind.LOCAL
            req.state = State.PREFILL
            self.prefilling.append(req)
            return
        req.computed = len(req.token_ids)
        self._prompt_done(req)
        self.events.publish()

    def cancel(self, req: SimRequest) -> None:
        """Drop a request wherever it is, freeing its blocks (idempotent)."""
        if req.state is State.DONE:
            return
        for queue in (self.waiting, self.prefilling, self.running, self.await_kv):
            if req in queue:
                queue.remove(req)
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        req.state = State.DONE
        self.events.publish()

    def load(self) -> tuple[int, int, int]:
        """(requests, KV blocks they hold, prompt tokens not yet computed): what a worker
        reports to routers (KvEventService.WatchLoad)."""
        requests = len(self.waiting) + len(self.prefilling) + len(self.running) + len(self.await_kv)
        held = self.pool.config.num_blocks - self.pool.blocks.num_free
        queued = sum(len(r.token_ids) - r.computed for q in (self.waiting, self.prefilling) for r in q
                     if r.kind is not Kind.REMOTE_KV)  # a prefill worker computes those
        return requests, held, queued

    # -- the iteration --------------------------------------------------------------------------

    def has_work(self) -> bool:
        self._admit()
        return bool(self.running or self.prefilling)

    def step(self, horizon: float | None = None) -> float:
        """One iteration: admit, grow, decode step + one prefill chunk; returns simulated seconds.

        With `horizon` (the offline replay's next arrival, engine-clock seconds), an iteration
        with no prefill chunk and nobody waiting fuses k identical-batch decode steps, as many
        as end by the horizon and before any request finishes (k >= 1): the same tokens, blocks
        and durations as k single steps, without k Python round trips.
        """
        self._admit()
        pool = self.pool
        batch = self.running[: self.max_running]
        kv_tokens = sum(len(r.token_ids) + r.generated for r in batch)
        chunk_req = self.prefilling[0] if self.prefilling else None
        steps = 1
        duration = self.timing.decode_s(len(batch), kv_tokens)
        if horizon is not None and batch and chunk_req is None and not self.waiting:
            steps, duration = self._fusable(batch, kv_tokens, horizon)
        for req in batch:  # as decode_worker/scheduler.py: room for the token each step writes
            pool.grow(req.block_ids, len(req.token_ids) + req.generated + steps - 1)
        chunk = 0
        if chunk_req is not None:
            chunk = min(self.chunk_size, len(chunk_req.token_ids) - chunk_req.computed)
            duration += self.timing.prefill_s(chunk_req.computed, chunk)
        self.events.publish()
        self.now += duration
        self.stats.busy_s += duration
        self.stats.decode_steps += steps if batch else 0
        for req in batch:
            req.generated += steps
            if req.generated >= req.max_tokens:
                self._finish(req)
            else:
                self.changed.append(req)
        if chunk_req is not None:
            chunk_req.computed += chunk
            self.stats.prefill_tokens += chunk
            if chunk_req.computed >= len(chunk_req.token_ids):
                self.prefilling.popleft()
                self._prompt_done(chunk_req)
        self.events.publish()
        return duration

    def _fusable(self, batch: list[SimRequest], kv_tokens: int, horizon: float) -> tuple[int, float]:
        """(k, seconds of k decode steps): k >= 1, no request finishes before step k, ends by horizon."""
        b = len(batch)
        k_max = min(r.max_tokens - r.generated for r in batch)
        k, total = 1, self.timing.decode_s(b, kv_tokens)
        while k < k_max:
            nxt = self.timing.decode_s(b, kv_tokens + k * b)
            if self.now + total + nxt > horizon:
                break
            total += nxt
            k += 1
        return k, total

    def take_changed(self) -> list[SimRequest]:
        out, self.changed = self.changed, []
        return out

    # -- internals ------------------------------------------------------------------------------

    def _outstanding(self) -> int:
        """Blocks admitted requests may still allocate (reserve minus what they hold)."""
        total = 0
        for queue in (self.prefilling, self.running, self.await_kv):
            for r in queue:
                total += max(0, self.pool.blocks_for(r.reserve_tokens) - len(r.block_ids))
        return total

    def _admit(self) -> None:
        if not self.waiting:
            return
        free = self.pool.blocks.num_free - self._outstanding()
        while self.waiting:
            req = self.waiting[0]
            need = self.pool.blocks_for(req.reserve_tokens)
            if need > free:
                return
            self.waiting.popleft()
            req.prompt = self.pool.allocate_prompt(req.token_ids)
            req.block_ids = req.prompt.block_ids
            req.cached_tokens = req.computed = req.prompt.num_cached_blocks * self.pool.block_size
            free -= need
            self.stats.requests += 1
            self.stats.prompt_tokens += len(req.token_ids)
            self.stats.cached_tokens += req.cached_tokens
            if req.kind is Kind.REMOTE_KV:
                req.state = State.AWAIT_KV
                self.await_kv.append(req)
                self.changed.append(req)
            else:
                req.state = State.PREFILL
                self.prefilling.append(req)

    def _prompt_done(self, req: SimRequest) -> None:
        """The prompt's KV is complete: cache its full blocks, the first token is out."""
        self.pool.commit_prompt(req.prompt)
        req.generated = 1
        req.first_token_at = self.now
        self.stats.first_tokens += 1
        if req.kind is Kind.PREFILL_ONLY or req.generated >= req.max_tokens:
            self._finish(req)
        else:
            req.state = State.RUNNING
            self.running.append(req)
            self.changed.append(req)

    def _finish(self, req: SimRequest) -> None:
        if req in self.running:
            self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.state = State.DONE
        req.finished_at = self.now
        self.changed.append(req)
