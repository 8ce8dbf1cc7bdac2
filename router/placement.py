"""route(): hash → look up overlaps → score decode → local or remote prefill → score prefill.

The KV-aware placement of docs/routing.md, including conditional disaggregation: the
decode worker prefills locally when no prefill worker is available or when the part of the
prompt it does not hold is shorter than `local_prefill_threshold` tokens.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from common.block_hash import block_hashes
from common.pb.tandem.v1 import discovery_pb2
from router.decision import RouteDecision
from router import cost_weight
from router.load import LoadTracker
from router.policy import make_policy
from router.workers import WorkerSet


class OverlapSource(Protocol):
    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]: ...


class NoOverlap:
    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        return {}


class NoWorker(Exception):
    """No SERVING decode worker is known (answered UNAVAILABLE)."""


@dataclass(frozen=True)
class PlacementOptions:
    mode: str = "kv"  # kv | approx | round-robin | random | least-loaded
    prefill_weight: float = 0.0  # cost of one uncached block relative to one active block; 0 = derived
    temperature: float = 0.0  # 0 = always the lowest cost
    local_prefill_threshold: int = 0  # tokens; prefill on the decode worker below this (0 = never by size)
    seed: int | None = None  # seeds random choices (random mode, temperature > 0); None = unseeded


class Placement:
    def __init__(self, workers: WorkerSet, load: LoadTracker, overlap: OverlapSource,
                 opts: PlacementOptions = PlacementOptions()) -> None:
        self.workers = workers
        self.load = load
        self.overlap = overlap
        self.opts = opts
        rng = (lambda k: random.Random(opts.seed + k)) if opts.seed is not None else (lambda k: None)
        self.last_weight = 0.0  # the prefill weight of the last decision (router metrics)
        self._kept: tuple | None = None  # (decodes, prefills, Announced, R) of the last candidate lists
        self.decode_policy = make_policy(opts.mode, opts.temperature, rng(0))
        self.prefill_policy = make_policy(opts.mode, opts.temperature, rng(1))

    def _announced(self, decodes: list[discovery_pb2.Instance],
                   prefills: list[discovery_pb2.Instance]) -> tuple[cost_weight.Announced, float]:
        """What the candidates announce (for W) and R, kept while the candidate lists are the
        same objects (router/workers.py)."""
        kept = self._kept
        if kept is None or kept[0] is not decodes or kept[1] is not prefills:
            kept = self._kept = (decodes, prefills, cost_weight.Announced(decodes + prefills),
                                 cost_weight.request_blocks(decodes, self.workers.block_size))
        return kept[2], kept[3]

    def _refused_note(self) -> str:
        """For the UNAVAILABLE message: the decode workers in discovery this router refuses, and why."""
        refused = self.workers.refused(discovery_pb2.ROLE_DECODE)
        if not refused:
            return ""
        return ("; refused decode workers: "
                + "; ".join(f"{inst.instance_id} at {inst.address} ({why})" for inst, why in refused[:5])
                + (f"; and {len(refused) - 5} more" if len(refused) > 5 else ""))

    def route(self, tokens: list[int], exclude: frozenset[str] = frozenset(),
              cache_salt: str = "") -> tuple[RouteDecision, list[int]]:
        """Choose the decode worker and the prefill worker (or local prefill) for a prompt.

        Args:
            exclude: decode instance ids not to choose (e.g. ones whose pool refused it).
            cache_salt: the tenant's cache salt (router/api_keys.py): the prompt is hashed with
                the seed the workers use for it, so only that tenant's cached blocks overlap.

        Returns:
            (the decision, the prompt's block hashes — empty in modes that ignore caches).
        Raises:
            NoWorker: no decode worker.
        """
        start, start_cpu = time.perf_counter(), time.thread_time()
        bs = self.workers.block_size
        uses_overlap = self.decode_policy.uses_overlap
        hashes = block_hashes(tokens, bs, self.workers.hash_seed_for(cache_salt)) if uses_overlap else []
        hashed = time.perf_counter()
        overlaps = self.overlap.overlaps(hashes) if hashes else {}
        blocks = len(tokens) // bs
        decodes = self.workers.candidates(discovery_pb2.ROLE_DECODE)
        if exclude:
            decodes = [d for d in decodes if d.instance_id not in exclude]
        if not decodes:
            raise NoWorker("no healthy decode worker" + (f" other than {', '.join(sorted(exclude))}" if exclude else "")
                           + self._refused_note())
        prefills = self.workers.candidates(discovery_pb2.ROLE_PREFILL)
        weight, request_blocks = 0.0, 0.0
        if uses_overlap:
            announced, request_blocks = self._announced(decodes, prefills)
            weight = self.opts.prefill_weight if self.opts.prefill_weight > 0 else \
                announced.weight(self.load.mean_output_tokens)
        self.last_weight = weight
        scored = self.decode_policy.score(discovery_pb2.ROLE_DECODE, decodes, overlaps, blocks, self.load, hashes,
                                          weight, prefills_here=not prefills, request_blocks=request_blocks)
        decode = self.decode_policy.pick(scored)
        queue_share = self.decode_policy.queue_share
        prefill, reason = None, ""
        # What the decode worker holds now (a prefix still in flight there is not in its pool yet).
        uncached = len(tokens) - overlaps.get(decode.instance_id, 0) * bs
        if not prefills:
            reason = "no prefill worker"
        elif uncached < self.opts.local_prefill_threshold:
            reason = f"uncached part {uncached} < threshold {self.opts.local_prefill_threshold} tokens"
        else:
            p_scored = self.prefill_policy.score(discovery_pb2.ROLE_PREFILL, prefills, overlaps, blocks, self.load,
                                                 hashes, weight)
            prefill = self.prefill_policy.pick(p_scored)
        decision = RouteDecision(self.opts.mode, len(tokens), blocks, decode, prefill, reason,
                                 (scored, p_scored) if prefill else (scored,),
                                 time.perf_counter() - start, weight, queue_share, request_blocks,
                                 self.prefill_policy.queue_share if prefill else 0.0,
                                 time.thread_time() - start_cpu, hashed - start)
        return decision, hashes
