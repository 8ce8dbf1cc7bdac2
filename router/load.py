"""The router's own account of the load it has placed on each worker.

What this router placed on each worker (docs/routing.md):
- in-flight requests per worker;
- active decode blocks per decode worker, de-duplicated: a full prompt block shared by several
  in-flight requests on one worker (a system prompt, a conversation's history) counts once, as
  it is held once in the worker's pool; each request's partial last prompt block and its
  generated blocks (one per `block_size` tokens) count on their own;
- queued prefill tokens per worker that prefills: uncached prompt tokens routed to it and not
  yet answered with a first token (a prefill worker, or a decode worker prefilling locally);
- the prompt blocks of in-flight requests per decode worker, and of prompts being prefilled per
  prefill worker (`inflight_prefix`): prefixes routed there whose KV may not be stored yet, so a
  second request with that prefix follows the first;
- the mean output length of requests that finished with a finish reason (an EWMA; cancelled
  calls and the attempts of a migrated request are not samples), which scales the default
  prefill weight (router/cost_weight.py).

With load reported by the workers (KvEventService.WatchLoad, router/load_watcher.py), the
placement reads a worker's requests, active blocks and queued prefill tokens as its last
report plus every change this router made there since that report (requests it placed, and
those that finished or got their first token since, which the report still counts) —
`requests`, `active`, `queued_tokens`, never below this router's own counts — so several routers
place on one view, a worker that just finished this router's request does not look busy until
its next report, and a report built before this router's newest call arrived does not hide it. A worker that
reports nothing is scored on this router's own counts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

OUTPUT_PRIOR_TOKENS = 256.0  # mean output length assumed before any request has finished
OUTPUT_EWMA = 0.02  # weight of each finished request in the mean output length


@dataclass
class RequestLoad:
    """What one routed request adds; released exactly once through LoadTracker."""

    decode_id: str
    prefill_id: str | None  # the worker that prefills it: a prefill worker, or decode_id when local
    decode_blocks: int  # the request's own blocks: prompt blocks + generated blocks
    prefill_tokens: int
    hashes: tuple[int, ...] = field(default=(), repr=False)  # its full prompt blocks (shared accounting)
    prefill_done: bool = False
    released: bool = False


class LoadTracker:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        self.active_blocks: defaultdict[str, int] = defaultdict(int)  # decode workers, de-duplicated
        self.prefill_tokens: defaultdict[str, int] = defaultdict(int)  # queued on the worker that prefills
        # worker -> prompt block hash -> in-flight requests with it (decode workers: until they
        # finish; prefill workers: until their first token)
        self._refs: defaultdict[str, dict[int, int]] = defaultdict(dict)
        self.mean_output_tokens = OUTPUT_PRIOR_TOKENS
        # prompt block hash -> workers with an in-flight request holding it (inflight_prefix's
        # candidates: only workers that share a prompt's first block can have a prefix of it)
        self._holders: dict[int, set[str]] = {}
        # worker -> [requests, active blocks, queued prefill tokens]: its last report.
        self.reported: dict[str, list[int]] = {}
        # The placement's view as arrays by worker slot (`slots`), so that scoring 1,000 workers
        # is a few vector operations: rows requests, active blocks, queued prefill tokens of
        # this router's own counts (_own), and of the last report plus every change this router
        # made there since (_rep; -inf for a worker that reports nothing).
        self._slot: dict[str, int] = {}
        self._own = np.zeros((3, 64))
        self._rep = np.full((3, 64), -np.inf)

    def slot(self, worker: str) -> int:
        """The worker's column in the view arrays (assigned on first sight, kept for good)."""
        s = self._slot.get(worker)
        if s is None:
            s = self._slot[worker] = len(self._slot)
            if s >= self._own.shape[1]:
                grow = self._own.shape[1]
                self._own = np.concatenate([self._own, np.zeros((3, grow))], axis=1)
                self._rep = np.concatenate([self._rep, np.full((3, grow), -np.inf)], axis=1)
        return s

    def slots(self, workers: Sequence[str]) -> np.ndarray:
        """The workers' slots, for `views`."""
        return np.fromiter((self.slot(w) for w in workers), dtype=np.intp, count=len(workers))

    def views(self, slots: np.ndarray) -> np.ndarray:
        """[3, n] float64: requests, active blocks and queued prefill tokens of the workers at
        `slots` as the placement sees them (`requests`, `active`, `queued_tokens`)."""
        return np.maximum(self._own[:, slots], self._rep[:, slots])

    def own_requests(self, slots: np.ndarray) -> np.ndarray:
        """This router's own in-flight requests on the workers at `slots` (float64)."""
        return self._own[0, slots]

    def report(self, worker: str, requests: int, active_blocks: int, queued_prefill_tokens: int) -> None:
        """A worker's own account of its load (router/load_watcher.py)."""
        self.reported[worker] = [requests, active_blocks, queued_prefill_tokens]
        s = self.slot(worker)  # before reading self._rep: a new slot may grow the arrays
        self._rep[:, s] = (requests, active_blocks, queued_prefill_tokens)

    def forget(self, worker: str) -> None:
        """The worker stopped reporting: score it on this router's own counts again."""
        if self.reported.pop(worker, None) is not None:
            self._rep[:, self._slot[worker]] = -np.inf

    def add(self, worker: str, requests: int = 0, blocks: int = 0, tokens: int = 0) -> None:
        """Count load on `worker` outside a RequestLoad (tests, what-if scoring)."""
        self._changed(worker, requests, blocks, tokens)

    def _changed(self, worker: str, requests: int, blocks: int, tokens: int) -> None:
        """Apply a change to this router's own counts of `worker`, and since its last report.
        The dicts are the counts' public form; the view arrays follow them here only: change
        them through this."""
        self.in_flight[worker] += requests
        self.active_blocks[worker] += blocks
        self.prefill_tokens[worker] += tokens
        s = self.slot(worker)
        change = (requests, blocks, tokens)
        self._own[:, s] += change
        if worker in self.reported:
            self._rep[:, s] += change

    def _view(self, worker: str, i: int) -> float:
        # Never below this router's own count: a report the worker built before this router's
        # newest call reached it does not hold that call, and the reset would hide it.
        s = self._slot.get(worker)
        return 0.0 if s is None else float(max(self._own[i, s], self._rep[i, s]))

    def requests(self, worker: str) -> float:
        return self._view(worker, 0)

    def active(self, worker: str) -> float:
        return self._view(worker, 1)

    def queued_tokens(self, worker: str) -> float:
        return self._view(worker, 2)

    def start(self, decode_id: str, prefill_id: str | None, prompt_tokens: int, uncached_tokens: int,
              hashes: Sequence[int] = (), local_prefill: bool = False) -> RequestLoad:
        """Count a routed request.

        Args:
            prefill_id: the prefill worker, or None when the decode worker prefills.
            uncached_tokens: prompt tokens the prefilling worker computes.
            hashes: the prompt's full-block hashes (router/placement.py); de-duplicates the
                request's prompt blocks against other in-flight requests on decode_id.
            local_prefill: count uncached_tokens as queued prefill on decode_id (prefill_id None).
        """
        on = prefill_id or (decode_id if local_prefill else None)
        load = RequestLoad(decode_id, on, -(-prompt_tokens // self.block_size),
                           uncached_tokens if on else 0, tuple(hashes))
        new = self._ref(decode_id, load.hashes)
        self._changed(decode_id, 1, new + load.decode_blocks - len(load.hashes), 0)
        if prefill_id:
            self._changed(prefill_id, 1, 0, 0)
            self._ref(prefill_id, load.hashes)
        if on:
            self._changed(on, 0, 0, load.prefill_tokens)
        return load

    def _ref(self, worker: str, hashes: tuple[int, ...]) -> int:
        """Reference `hashes` on `worker`; returns how many were not referenced there yet."""
        refs = self._refs[worker]
        new = 0
        for h in hashes:
            n = refs.get(h, 0)
            refs[h] = n + 1
            if not n:
                new += 1
                self._holders.setdefault(h, set()).add(worker)
        return new

    def _unref(self, worker: str, hashes: tuple[int, ...]) -> int:
        """Drop one reference of each of `hashes` on `worker`; returns how many left it."""
        refs = self._refs[worker]
        gone = 0
        for h in hashes:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
                gone += 1
                holders = self._holders[h]
                holders.discard(worker)
                if not holders:
                    del self._holders[h]
        if not refs:
            del self._refs[worker]
        return gone

    def inflight_prefix(self, worker: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` that requests in flight on `worker` also have (chained
        hashes: a block matches only after the same prefix)."""
        refs = self._refs.get(worker)
        if not refs:
            return 0
        n = 0
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    def inflight_prefixes(self, hashes: Sequence[int]) -> dict[str, int]:
        """`inflight_prefix` of every worker where it is not 0."""
        if not hashes:
            return {}
        return {w: self.inflight_prefix(w, hashes) for w in self._holders.get(hashes[0], ())}

    def prefill_finished(self, load: RequestLoad) -> None:
        if load.prefill_id and not load.prefill_done:
            load.prefill_done = True
            remote = load.prefill_id != load.decode_id
            if remote:
                self._unref(load.prefill_id, load.hashes)
            self._changed(load.prefill_id, -1 if remote else 0, 0, -load.prefill_tokens)
            if remote:
                self._prune(load.prefill_id)

    def grow(self, load: RequestLoad, generated_before: int, generated_now: int) -> None:
        """Account one more decode block for every block_size tokens generated."""
        added = generated_now // self.block_size - generated_before // self.block_size
        if added and not load.released:
            load.decode_blocks += added
            self._changed(load.decode_id, 0, added, 0)

    def finish(self, load: RequestLoad) -> None:
        if load.released:
            return
        self.prefill_finished(load)
        load.released = True
        gone = self._unref(load.decode_id, load.hashes)
        self._changed(load.decode_id, -1, -(gone + load.decode_blocks - len(load.hashes)), 0)
        self._prune(load.decode_id)

    def _prune(self, worker: str) -> None:
        """Drop a worker's counters once they are all zero (workers come and go)."""
        if not (self.in_flight.get(worker) or self.active_blocks.get(worker) or self.prefill_tokens.get(worker)):
            for d in (self.in_flight, self.active_blocks, self.prefill_tokens):
                d.pop(worker, None)

    def request_finished(self, output_tokens: int) -> None:
        """A request ended with a finish reason after `output_tokens` generated tokens (all its
        attempts): one sample of the mean output length."""
        self.mean_output_tokens += OUTPUT_EWMA * (output_tokens - self.mean_output_tokens)
