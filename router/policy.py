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

from common.pb.tandem.v1 import discovery_pb2
from router.decision import Candidate
from router.load import LoadTracker

MODES = ("kv", "approx", "round-robin", "random", "least-loaded")
TRANSFER_WEIGHT = 1.0  # decode worker with prefill workers present: an uncached block costs one active block
_ROLE = {discovery_pb2.ROLE_PREFILL: "prefill", discovery_pb2.ROLE_DECODE: "decode"}


class Policy:
    """Scores candidates of one role and picks one (each role has its own Policy)."""

    uses_overlap = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        # Ties rotate from a random start: router replicas (separate processes) must not all
        # send their first tied requests to the same worker.
        self._tick = itertools.count(self._rng.randrange(1 << 30))

    def load_of(self, role: int, inst: discovery_pb2.Instance, load: LoadTracker) -> float:
        return float(load.in_flight.get(inst.instance_id, 0))

    def score(self, role: int, candidates: Sequence[discovery_pb2.Instance], overlaps: Mapping[str, int],
              blocks: int, load: LoadTracker, hashes: Sequence[int] = (), weight: float = 1.0,
              prefills_here: bool = True, request_blocks: float = 0.0) -> list[Candidate]:
        """One Candidate per instance. The rest is for the kv/approx cost: `hashes` (the prompt's
        block hashes), `weight` (W), `prefills_here` (decode: no prefill worker exists, so the
        decode worker computes what it lacks) and `request_blocks` (R); a decode instance's
        kv_capacity_blocks (0 = unknown) bounds the blocks it has room for."""
        out = []
        for inst in candidates:
            w = self.load_of(role, inst, load)
            out.append(Candidate(inst.instance_id, inst.address, _ROLE[role], overlaps.get(inst.instance_id, 0), w, w))
        return out

    queue_share = 0.0  # kv/approx: the last score()'s 1 / (1 + b), for explain

    def pick(self, scored: Sequence[Candidate]) -> Candidate:
        """Lowest cost; ties rotate so equal workers share the load."""
        best = min(c.cost for c in scored)
        tied = sorted((c for c in scored if c.cost == best), key=lambda c: c.instance_id)
        if not tied:  # a NaN cost (it compares false with everything): rotate over all, never fail
            tied = sorted(scored, key=lambda c: c.instance_id)
        return tied[next(self._tick) % len(tied)]


class KvPolicy(Policy):
    uses_overlap = True

    def __init__(self, temperature: float = 0.0, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.temperature = temperature

    def score(self, role: int, candidates: Sequence[discovery_pb2.Instance], overlaps: Mapping[str, int],
              blocks: int, load: LoadTracker, hashes: Sequence[int] = (), weight: float = 1.0,
              prefills_here: bool = True, request_blocks: float = 0.0) -> list[Candidate]:
        out = []
        output_blocks = load.mean_output_tokens / load.block_size  # what this request will add as it decodes
        decode = role == discovery_pb2.ROLE_DECODE
        # Queued work ahead delays only this request; its own uncached blocks also hold up the
        # requests running on that worker (b per worker on average): the queue counts 1/(1 + b).
        self.queue_share = 1.0 / (1.0 + sum(load.requests(i.instance_id) for i in candidates) / max(1, len(candidates)))
        # A decode worker computes the blocks it lacks only when no prefill worker does; otherwise
        # they are transferred into it, and cost what they will hold there.
        uncached_weight = weight if (prefills_here or not decode) else TRANSFER_WEIGHT
        for inst in candidates:
            wid = inst.instance_id
            queued = load.queued_tokens(wid) / load.block_size
            inflight = load.inflight_prefix(wid, hashes)
            overlap = max(overlaps.get(wid, 0), inflight)
            prefill_cost = uncached_weight * (blocks - overlap) + weight * self.queue_share * queued
            if decode:
                active = load.active(wid)
                adds = blocks - inflight + output_blocks
                room = inst.kv_capacity_blocks
                overflow = max(0.0, active + adds - room) if room > 0 else 0.0
                cost = (prefill_cost + active + request_blocks * load.requests(wid) + (blocks - inflight)
                        + weight * overflow)
                out.append(Candidate(wid, inst.address, "decode", overlap, active, cost, queued, inflight))
            else:
                out.append(Candidate(wid, inst.address, "prefill", overlap, queued, prefill_cost, queued, inflight))
        return out

    def pick(self, scored: Sequence[Candidate]) -> Candidate:
        if self.temperature <= 0 or len(scored) == 1:
            return super().pick(scored)
        lo = min(c.cost for c in scored)
        span = max(c.cost for c in scored) - lo
        if span == 0:
            return super().pick(scored)
        weights = [math.exp(-(c.cost - lo) / (span * self.temperature)) for c in scored]
        return self._rng.choices(list(scored), weights=weights)[0]


class RoundRobin(Policy):
    def pick(self, scored: Sequence[Candidate]) -> Candidate:
        ordered = sorted(scored, key=lambda c: c.instance_id)
        return ordered[next(self._tick) % len(ordered)]


class RandomChoice(Policy):
    def pick(self, scored: Sequence[Candidate]) -> Candidate:
        return self._rng.choice(list(scored))


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
