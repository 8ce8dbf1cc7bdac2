"""A routing decision with its inputs, so every choice can be explained (debug log,
`tandem explain`, and span attributes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np


@dataclass(frozen=True)
class Candidate:
    instance_id: str
    address: str
    role: str  # "prefill" | "decode"
    overlap_blocks: int  # leading prompt blocks the worker holds or has in flight (kv/approx)
    load: float  # decode: active blocks; prefill: queued prefill blocks; other modes: in-flight requests
    cost: float  # lower is better; see router/policy.py for the formula of each mode
    queued_blocks: float = 0.0  # kv/approx: prefill work queued on the worker, in blocks
    shared_blocks: int = 0  # kv/approx decode: prompt blocks already active there (counted once)


@dataclass(frozen=True)
class Scores:
    """One role's candidates as arrays, index-aligned with `instances` (router/policy.py
    scores them so; Candidate objects are built only when asked: explain, spans, tests).
    Arrays are float64 of length len(instances): overlap_blocks, load, cost, queued_blocks,
    shared_blocks as in Candidate."""

    role: str  # "prefill" | "decode"
    instances: Sequence  # discovery_pb2.Instance
    overlap: np.ndarray
    load: np.ndarray
    cost: np.ndarray
    queued: np.ndarray
    shared: np.ndarray

    def __len__(self) -> int:
        return len(self.instances)

    def candidate(self, i: int) -> Candidate:
        inst = self.instances[i]
        return Candidate(inst.instance_id, inst.address, self.role, int(self.overlap[i]), float(self.load[i]),
                         float(self.cost[i]), float(self.queued[i]), int(self.shared[i]))

    def candidates(self) -> Iterator[Candidate]:
        return (self.candidate(i) for i in range(len(self.instances)))

    @classmethod
    def of(cls, role: str, cands: Sequence[Candidate]) -> "Scores":
        """From Candidate objects (their instance_id and address stand in for the instances)."""
        col = lambda f: np.array([float(getattr(c, f)) for c in cands])  # noqa: E731
        return cls(role, [_Named(c.instance_id, c.address) for c in cands], col("overlap_blocks"), col("load"),
                   col("cost"), col("queued_blocks"), col("shared_blocks"))


@dataclass(frozen=True)
class _Named:
    instance_id: str
    address: str


@dataclass(frozen=True)
class RouteDecision:
    mode: str
    prompt_tokens: int
    prompt_blocks: int  # full blocks (the hashed ones)
    decode: Candidate
    prefill: Candidate | None  # None: the decode worker prefills locally
    local_prefill_reason: str = ""  # why prefill runs on the decode worker, when it does
    scored: tuple[Scores, ...] = field(default=())  # each role's candidates (Candidate objects built when asked)
    seconds: float = 0.0  # time to decide (hash + lookup + scoring)
    prefill_weight: float = 0.0  # kv/approx: the weight the costs used (router/cost_weight.py)
    queue_share: float = 0.0  # kv/approx decode: 1 / (1 + b), the weight of queued prefill (router/policy.py)
    request_blocks: float = 0.0  # kv/approx decode: R, one request's cost in active blocks
    prefill_queue_share: float = 0.0  # kv/approx: the prefill workers' 1 / (1 + b)
    cpu_seconds: float = 0.0  # the router thread's CPU time for it (wall time less any wait for a core)
    hash_seconds: float = 0.0  # of `seconds`, hashing the prompt's blocks (grows with the prompt, not the fleet)

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """Every candidate scored for this decision, each role's in discovery order."""
        return tuple(c for scores in self.scored for c in scores.candidates())

    def uncached_tokens(self, block_size: int) -> int:
        """Prompt tokens the prefilling worker (the prefill worker, else the decode worker) is
        expected to compute: those past its overlap (held or in flight there)."""
        return self.prompt_tokens - (self.prefill or self.decode).overlap_blocks * block_size

    def explain(self) -> str:
        """A human-readable table of the candidates and the choice."""
        lines = [f"mode={self.mode} prompt={self.prompt_tokens} tokens ({self.prompt_blocks} full blocks) "
                 f"decided in {self.seconds * 1e6:.0f} us"
                 + (f" prefill_weight={self.prefill_weight:.3g} queue_share={self.queue_share:.3g}"
                    f" request_blocks={self.request_blocks:.3g}"
                    + (f" prefill_queue_share={self.prefill_queue_share:.3g}" if self.prefill else "")
                    if self.prefill_weight else "")]
        if self.prefill_weight:  # what the figures mean (every term in active decode blocks)
            from router.policy import TRANSFER_WEIGHT  # (policy imports this module)
            lines.append("cost in active decode blocks (docs/routing.md), B = full prompt blocks: decode = "
                         "W_u*(B - overlap) + prefill_weight*queued*queue_share + load + request_blocks*requests "
                         f"+ (B - shared) + prefill_weight*overflow (W_u = prefill_weight when it prefills "
                         f"itself, else {TRANSFER_WEIGHT:g}); prefill = prefill_weight*(B - overlap + "
                         f"queued*prefill_queue_share)")
        lines.append(f"{'role':8} {'instance':28} {'overlap':>8} {'queued':>8} {'load':>8} {'shared':>7} {'cost':>9}  chosen")
        chosen = {self.decode.instance_id} | ({self.prefill.instance_id} if self.prefill else set())
        for c in sorted(self.candidates, key=lambda c: (c.role, c.cost)):
            mark = "*" if c.instance_id in chosen else ""
            lines.append(f"{c.role:8} {c.instance_id:28} {c.overlap_blocks:8d} {c.queued_blocks:8.1f} {c.load:8.1f} "
                         f"{c.shared_blocks:7d} {c.cost:9.2f}  {mark}")
        lines.append("prefill: " + (self.prefill.instance_id if self.prefill else f"local ({self.local_prefill_reason})"))
        return "\n".join(lines)
