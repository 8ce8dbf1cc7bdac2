"""Where the routed experts live over the EP ranks, and redundant copies of hot experts.

A placement gives each expert one owner rank, plus optional redundant copies (expert, rank)
of hot experts, the same for every MoE layer. Planning copies from observed expert loads
follows DeepSeek's EPLB (github.com/deepseek-ai/EPLB, "redundant experts"): replicate the
expert with the highest load per copy onto the least-loaded rank that lacks it, and repeat.
The dispatcher (engine/moe_ep.py) spreads an expert's tokens over its copies in turn, so each
copy gets an even share (what `rank_loads` and the planner assume); preferring a copy on the
token's own rank would save traffic but skew the split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class ExpertPlacement:
    """owner[e] = the rank holding expert e; replicas = extra (expert, rank) copies.

    Raises ValueError when a rank is out of range, holds no expert, or a copy repeats a holder.
    """

    owner: tuple[int, ...]
    world_size: int
    replicas: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.owner)
        if any(not 0 <= r < self.world_size for r in self.owner):
            raise ValueError(f"expert placement {self.owner}: owners must be in [0, {self.world_size})")
        seen = {(e, r) for e, r in enumerate(self.owner)}
        for e, r in self.replicas:
            if not (0 <= e < n and 0 <= r < self.world_size) or (e, r) in seen:
                raise ValueError(f"expert placement: copy of expert {e} on rank {r} is out of range or repeated")
            seen.add((e, r))
        empty = [r for r in range(self.world_size) if not self.local_experts(r)]
        if empty:
            raise ValueError(f"expert placement {self.owner}: ranks {empty} hold no expert")

    @classmethod
    def contiguous(cls, n_experts: int, world_size: int) -> ExpertPlacement:
        """Expert e on rank e // (n_experts / world_size). Raises ValueError (naming --ep-size)
        unless world_size divides n_experts."""
        if world_size < 1 or n_experts % world_size:
            raise ValueError(f"--ep-size {world_size} must divide n_routed_experts ({n_experts})")
        per = n_experts // world_size
        return cls(tuple(e // per for e in range(n_experts)), world_size)

    @property
    def n_experts(self) -> int:
        return len(self.owner)

    def holders(self, expert: int) -> list[int]:
        """Ranks holding `expert`: its owner first, then its copies in ascending rank order."""
        return [self.owner[expert]] + sorted(r for e, r in self.replicas if e == expert)

    def local_experts(self, rank: int) -> list[int]:
        """Expert ids `rank` holds (owned or copies), ascending."""
        return sorted({e for e, r in enumerate(self.owner) if r == rank}
                      | {e for e, r in self.replicas if r == rank})

    def slots(self) -> list[tuple[int, int]]:
        """(rank, expert) for every held copy, rank-major then expert: the layout of the
        dispatch buffers."""
        return [(r, e) for r in range(self.world_size) for e in self.local_experts(r)]

    def to_json(self) -> str:
        return json.dumps({"owner": list(self.owner), "world_size": self.world_size,
                           "replicas": [list(x) for x in self.replicas]})

    @classmethod
    def from_file(cls, path: str, n_experts: int, world_size: int) -> ExpertPlacement:
        """Read `to_json` output; raises ValueError (naming --ep-placement) when it does not fit
        the model or --ep-size."""
        try:
            d = json.loads(Path(path).read_text())
            p = cls(tuple(d["owner"]), int(d["world_size"]), tuple((int(e), int(r)) for e, r in d.get("replicas", [])))
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"--ep-placement {path}: {exc}") from None
        if p.n_experts != n_experts or p.world_size != world_size:
            raise ValueError(f"--ep-placement {path}: {p.n_experts} experts over {p.world_size} ranks, but the "
                             f"model has {n_experts} and --ep-size is {world_size}")
        return p


def rank_loads(load: Sequence[float], placement: ExpertPlacement) -> list[float]:
    """Expected load per rank when every expert's load splits evenly over its copies."""
    out = [0.0] * placement.world_size
    for e, x in enumerate(load):
        holders = placement.holders(e)
        for r in holders:
            out[r] += x / len(holders)
    return out


def plan_redundant(load: Sequence[float], base: ExpertPlacement, n_redundant: int) -> ExpertPlacement:
    """Add up to `n_redundant` copies of hot experts to `base` (EPLB's greedy rule).

    load: observed tokens (or pairs) routed to each expert, [n_experts]. Returns a placement
    whose `rank_loads` are no worse balanced than base's.
    """
    if len(load) != base.n_experts:
        raise ValueError(f"load of {len(load)} experts for a placement of {base.n_experts}")
    copies = [base.holders(e) for e in range(base.n_experts)]
    extra = list(base.replicas)
    rank_load = rank_loads(load, base)
    for _ in range(n_redundant):
        by_heat = sorted(range(base.n_experts), key=lambda e: (-load[e] / len(copies[e]), e))
        pick = next(((e, [r for r in range(base.world_size) if r not in copies[e]]) for e in by_heat
                     if len(copies[e]) < base.world_size), None)
        if pick is None or load[pick[0]] <= 0:
            break
        e, free = pick
        r = min(free, key=lambda x: (rank_load[x], x))
        old, new = load[e] / len(copies[e]), load[e] / (len(copies[e]) + 1)
        if rank_load[r] + new >= max(rank_load[h] for h in copies[e]):
            break  # the copy would not lower the peak
        for h in copies[e]:
            rank_load[h] -= old - new
        rank_load[r] += new
        copies[e].append(r)
        extra.append((e, r))
    return ExpertPlacement(base.owner, base.world_size, tuple(extra))
