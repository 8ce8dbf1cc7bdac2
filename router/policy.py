"""Worker choice per role, one class per router mode (`--router-mode`).

kv / approx (docs/routing.md), in units of one active decode block:
    decode:  cost_w = W × (B − overlap_w + queued_w / (1 + b)) + active_w + (B − shared_w)
    prefill: cost_w = W × (B − overlap_w + queued_w / (1 + b))
with B the prompt's full blocks; overlap_w the leading blocks worker w holds (the KV index) or
has in flight (prompt blocks of requests this router routed there and that are not finished:
their KV may not be stored yet); queued_w the uncached prompt blocks routed to w and not yet
prefilled (w prefills them: a prefill worker, or a decode worker prefilling locally); active_w
the router's active decode blocks on w, each block shared by several requests counted once;
shared_w the leading blocks of this prompt already active on w (they add no new decode block);
b the mean in-flight requests per candidate of the role (queued work ahead delays only this
request, while its own uncached blocks also hold up the b requests running there);
W the prefill weight (router/cost_weight.py: derived from the workers' announced timings and
the mean output length unless --prefill-weight is given). Lowest cost wins; ties rotate; with
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
_ROLE = {discovery_pb2.ROLE_PREFILL: "prefill", discovery_pb2.ROLE_DECODE: "decode"}


class Policy:
    """Scores candidates of one role and picks one (each role has its own Policy)."""

    uses_overlap = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._tick = itertools.count()
        self._rng = rng or random.Random()

    def load_of(self, role: int, inst: discovery_pb2.Instance, load: LoadTracker) -> float:
        return float(load.in_flight.get(inst.instance_id, 0))

    def score(self, role: int, candidates: Sequence[discovery_pb2.Instance], overlaps: Mapping[str, int],
              blocks: int, load: LoadTracker, hashes: Sequence[int] = (), weight: float = 1.0) -> list[Candidate]:
        """One Candidate per instance; `hashes` (the prompt's block hashes) and `weight` (the
        prefill weight) are for the kv/approx cost."""
        out = []
        for inst in candidates:
            w = self.load_of(role, inst, load)
            out.append(Candidate(inst.instance_id, inst.address, _ROLE[role], overlaps.get(inst.instance_id, 0), w, w))
        return out

    def pick(self, scored: Sequence[Candidate]) -> Candidate:
        """Lowest cost; ties rotate so equal workers share the load."""
        best = min(c.cost for c in scored)
        tied = sorted((c for c in scored if c.cost == best), key=lambda c: c.instance_id)
        return tied[next(self._tick) % len(tied)]


class KvPolicy(Policy):
    uses_overlap = True

    def __init__(self, temperature: float = 0.0, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.temperature = temperature

    def score(self, role: int, candidates: Sequence[discovery_pb2.Instance], overlaps: Mapping[str, int],
              blocks: int, load: LoadTracker, hashes: Sequence[int] = (), weight: float = 1.0) -> list[Candidate]:
        out = []
        decode = role == discovery_pb2.ROLE_DECODE
        # Queued work ahead delays only this request; its own uncached blocks also hold up the
        # requests running on that worker (b per worker on average): the queue counts 1/(1 + b).
        running = sum(load.requests(i.instance_id) for i in candidates) / max(1, len(candidates))
        queue_share = 1.0 / (1.0 + running)
        for inst in candidates:
            wid = inst.instance_id
            queued = load.queued_tokens(wid) / load.block_size
            if decode:
                shared = load.inflight_prefix(wid, hashes)
                overlap = max(overlaps.get(wid, 0), shared)
                active = load.active(wid)
                cost = weight * (blocks - overlap + queue_share * queued) + active + (blocks - shared)
                out.append(Candidate(wid, inst.address, "decode", overlap, active, cost, queued, shared))
            else:
                overlap = overlaps.get(wid, 0)
                out.append(Candidate(wid, inst.address, "prefill", overlap, queued,
                                     weight * (blocks - overlap + queue_share * queued), queued))
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
