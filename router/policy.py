"""Worker choice per role, one class per router mode (`--router-mode`).

kv / approx (DESIGN.md section 4, as NVIDIA Dynamo's KV router):
    cost_w = prefill_weight × (B − overlap_w) + load_w
with B the prompt's full blocks, overlap_w the leading blocks worker w holds, and load_w the
router's active decode blocks on w (decode) or queued prefill blocks (prefill). Lowest cost
wins; ties rotate; with temperature T > 0 a worker is drawn with
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

    def cost(self, blocks: int, overlap: int, load: float) -> float:
        return load

    def score(self, role: int, candidates: Sequence[discovery_pb2.Instance], overlaps: Mapping[str, int],
              blocks: int, load: LoadTracker) -> list[Candidate]:
        out = []
        for inst in candidates:
            o = overlaps.get(inst.instance_id, 0)
            w = self.load_of(role, inst, load)
            out.append(Candidate(inst.instance_id, inst.address, _ROLE[role], o, w, self.cost(blocks, o, w)))
        return out

    def pick(self, scored: Sequence[Candidate]) -> Candidate:
        """Lowest cost; ties rotate so equal workers share the load."""
        best = min(c.cost for c in scored)
        tied = sorted((c for c in scored if c.cost == best), key=lambda c: c.instance_id)
        return tied[next(self._tick) % len(tied)]


class KvPolicy(Policy):
    uses_overlap = True

    def __init__(self, prefill_weight: float = 1.0, temperature: float = 0.0, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.prefill_weight = prefill_weight
        self.temperature = temperature

    def load_of(self, role: int, inst: discovery_pb2.Instance, load: LoadTracker) -> float:
        if role == discovery_pb2.ROLE_DECODE:
            return float(load.active_blocks.get(inst.instance_id, 0))
        return load.prefill_tokens.get(inst.instance_id, 0) / load.block_size

    def cost(self, blocks: int, overlap: int, load: float) -> float:
        return self.prefill_weight * (blocks - overlap) + load

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


def make_policy(mode: str, prefill_weight: float = 1.0, temperature: float = 0.0,
                rng: random.Random | None = None) -> Policy:
    """`rng` drives random choices (None: a fresh unseeded one). Raises ValueError naming
    --router-mode for an unknown mode."""
    if mode in ("kv", "approx"):
        return KvPolicy(prefill_weight, temperature, rng)
    if mode == "round-robin":
        return RoundRobin(rng)
    if mode == "random":
        return RandomChoice(rng)
    if mode == "least-loaded":
        return LeastLoaded(rng)
    raise ValueError(f"--router-mode must be one of {', '.join(MODES)}; got {mode!r}")
