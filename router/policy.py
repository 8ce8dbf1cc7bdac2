"""Worker choice per role, one class per router mode (`--router-mode`).

kv / approx (docs/routing.md), in units of one active decode block:
    decode:  cost_w = W_u × (B − overlap_w) + W × queued_w / (1 + b) + active_w + R × n_w
                      + (B − shared_w) + W × overflow_w
    prefill: cost_w = W × (B − overlap_w) + W × queued_w / (1 + b)
with B the prompt's full blocks; overlap_w the leading blocks worker w holds (the KV index) or
has in flight (prompt blocks of requests this router routed there and that are not finished:
their KV may not be stored yet); queued_w the uncached prompt blocks routed to w and not yet
prefilled (w prefills them: a prefill worker, or a decode worker prefilling locally); active_w
the router's active decode blocks on w, each block shared by several requests counted once;
shared_w the leading blocks of this prompt already active on w (they add no new decode block);
b the mean in-flight requests per candidate of the role (queued work ahead delays only this
request, while its own uncached blocks also hold up the b requests running there);
W the prefill weight (router/cost_weight.py: derived from the workers' announced timings and
the mean output length unless --prefill-weight is given); W_u = W where the decode worker
computes what it lacks (no prefill worker), else TRANSFER_WEIGHT (those blocks are transferred
into it by the prefill worker, which computes them). Prefill workers count in-flight prefixes
too (prompts they are prefilling now). n_w the requests on w and R one request's cost in active
blocks (a decode step's per-request time over its per-block time, router/cost_weight.py);
overflow_w the blocks by which w's active blocks, this request's new ones and its expected
output (mean output length / block size) exceed w's kv_capacity_blocks (they would wait). Lowest cost wins; ties rotate; with
temperature T > 0 a worker is drawn with
    p_w ∝ exp(−(c_w − c_min) / ((c_max − c_min) · T)).
round-robin, random, least-loaded ignore the KV caches (least-loaded: fewest in-flight requests).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Mapping, Sequence

import numpy as np

from common.pb.tandem.v1 import discovery_pb2
from router.decision import Candidate, Scores
from router.load import LoadTracker

MODES = ("kv", "approx", "round-robin", "random", "least-loaded")
TRANSFER_WEIGHT = 1.0  # decode worker with prefill workers present: an uncached block costs one active block
_ROLE = {discovery_pb2.ROLE_PREFILL: "prefill", discovery_pb2.ROLE_DECODE: "decode"}


class _Columns:
    """What scoring derives from one candidate list and keeps while WorkerSet hands out the same
    list object (router/workers.py): ids, their position, LoadTracker slots, tie order, pools."""

    def __init__(self, candidates: Sequence[discovery_pb2.Instance], load: LoadTracker) -> None:
        self.candidates, self.load = candidates, load
        self.ids = [i.instance_id for i in candidates]
        self.pos = {wid: j for j, wid in enumerate(self.ids)}
        self.slots = load.slots(self.ids)
        rank = np.empty(len(self.ids), dtype=np.intp)
        rank[sorted(range(len(self.ids)), key=self.ids.__getitem__)] = np.arange(len(self.ids))
        self.rank = rank  # position in instance id order (ties rotate in that order)
        self.room = np.array([float(i.kv_capacity_blocks) for i in candidates])

    def sparse(self, values: Mapping[str, int]) -> np.ndarray:
        """A {instance id: n} map as a column (0 where absent, ids not among the candidates ignored)."""
        col = np.zeros(len(self.ids))
        for wid, n in values.items():
            j = self.pos.get(wid)
            if j is not None:
                col[j] = n
        return col


class Policy:
    """Scores candidates of one role and picks one (each role has its own Policy)."""

    uses_overlap = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        # Ties rotate from a random start: router replicas (separate processes) must not all
        # send their first tied requests to the same worker.
        self._tick = itertools.count(self._rng.randrange(1 << 30))
        self._cols: _Columns | None = None

    def columns(self, candidates: Sequence[discovery_pb2.Instance], load: LoadTracker) -> _Columns:
        cols = self._cols
        if cols is None or cols.candidates is not candidates or cols.load is not load:
            cols = self._cols = _Columns(candidates, load)
        return cols

    def score(self, role: int, candidates: Sequence[discovery_pb2.Instance], overlaps: Mapping[str, int],
              blocks: int, load: LoadTracker, hashes: Sequence[int] = (), weight: float = 1.0,
              prefills_here: bool = True, request_blocks: float = 0.0) -> Scores:
        """Every candidate's cost (Scores, aligned with `candidates`). The rest is for the
        kv/approx cost: `hashes` (the prompt's block hashes), `weight` (W), `prefills_here`
        (decode: no prefill worker exists, so the decode worker computes what it lacks) and
        `request_blocks` (R); a decode instance's kv_capacity_blocks (0 = unknown) bounds the
        blocks it has room for. Here (round-robin, random, least-loaded): this router's own
        in-flight requests."""
        cols = self.columns(candidates, load)
        n = load.own_requests(cols.slots)
        zero = np.zeros(len(candidates))
        return Scores(_ROLE[role], candidates, cols.sparse(overlaps), n, n, zero, zero)

    queue_share = 0.0  # kv/approx: the last score()'s 1 / (1 + b), for explain

    def pick(self, scored: Scores) -> Candidate:
        """Lowest cost; ties rotate (in instance id order) so equal workers share the load; a
        NaN cost never wins (all NaN: rotate over all)."""
        cost = scored.cost
        ok = ~np.isnan(cost)
        idx = np.flatnonzero(cost == cost[ok].min()) if ok.any() else np.arange(len(cost))
        if len(idx) > 1:
            idx = self._ordered(scored, idx)
        return scored.candidate(int(idx[next(self._tick) % len(idx)]))

    def _ordered(self, scored: Scores, idx: np.ndarray) -> np.ndarray:
        """idx in instance id order."""
        cols = self._cols
        if cols is not None and cols.candidates is scored.instances:
            return idx[np.argsort(cols.rank[idx], kind="stable")]
        return np.array(sorted(idx, key=lambda j: scored.instances[j].instance_id), dtype=np.intp)


class KvPolicy(Policy):
    uses_overlap = True

    def __init__(self, temperature: float = 0.0, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.temperature = temperature

    def score(self, role: int, candidates: Sequence[discovery_pb2.Instance], overlaps: Mapping[str, int],
              blocks: int, load: LoadTracker, hashes: Sequence[int] = (), weight: float = 1.0,
              prefills_here: bool = True, request_blocks: float = 0.0) -> Scores:
        cols = self.columns(candidates, load)
        output_blocks = load.mean_output_tokens / load.block_size  # what this request will add as it decodes
        decode = role == discovery_pb2.ROLE_DECODE
        requests, active, queued_tokens = load.views(cols.slots)
        # Queued work ahead delays only this request; its own uncached blocks also hold up the
        # requests running on that worker (b per worker on average): the queue counts 1/(1 + b).
        self.queue_share = 1.0 / (1.0 + float(requests.sum()) / max(1, len(candidates)))
        # A decode worker computes the blocks it lacks only when no prefill worker does; otherwise
        # they are transferred into it, and cost what they will hold there.
        uncached_weight = weight if (prefills_here or not decode) else TRANSFER_WEIGHT
        queued = queued_tokens / load.block_size
        inflight = cols.sparse(load.inflight_prefixes(hashes))
        overlap = np.maximum(cols.sparse(overlaps), inflight)
        prefill_cost = uncached_weight * (blocks - overlap) + weight * self.queue_share * queued
        if not decode:
            return Scores("prefill", candidates, overlap, queued, prefill_cost, queued, inflight)
        adds = blocks - inflight + output_blocks
        room = cols.room
        overflow = np.where(room > 0, np.maximum(0.0, active + adds - room), 0.0)
        cost = prefill_cost + active + request_blocks * requests + (blocks - inflight) + weight * overflow
        return Scores("decode", candidates, overlap, active, cost, queued, inflight)

    def pick(self, scored: Scores) -> Candidate:
        if self.temperature <= 0 or len(scored) == 1:
            return super().pick(scored)
        cost = scored.cost
        lo, span = float(cost.min()), float(cost.max() - cost.min())
        if span == 0 or math.isnan(span):
            return super().pick(scored)
        weights = np.exp(-(cost - lo) / (span * self.temperature))
        return scored.candidate(self._rng.choices(range(len(cost)), weights=weights.tolist())[0])


class RoundRobin(Policy):
    def pick(self, scored: Scores) -> Candidate:
        order = self._ordered(scored, np.arange(len(scored)))
        return scored.candidate(int(order[next(self._tick) % len(order)]))


class RandomChoice(Policy):
    def pick(self, scored: Scores) -> Candidate:
        return scored.candidate(self._rng.randrange(len(scored)))


class LeastLoaded(Policy):
    """Fewest in-flight requests placed by this router (the skeleton's policy)."""


def make_policy(mode: str, temperature: float = 0.0, rng: random.Random | None = None) -> Policy:
    """`rng` drives random choices (None: a fresh unseeded one). Raises ValueError naming
    --router-mode for an unknown mode."""
    if mode in ("kv", "approx"):
        return KvPolicy(temperature, rng)
    if mode == "round-robin":
        return RoundRobin(rng)
    if mode == "random":
        return RandomChoice(rng)
    if mode == "least-loaded":
        return LeastLoaded(rng)
    raise ValueError(f"--router-mode must be one of {', '.join(MODES)}; got {mode!r}")
