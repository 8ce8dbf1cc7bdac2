"""Prefill chunk planning: static chunks, or dynamic chunks fitted to a time model.

Dynamic chunking follows SGLang's dynamic chunked prefill: from start-up timings of prefills of
several lengths fit `f(l) = a·l² + b·l + c` (seconds for l tokens), take the target
`T = f(base) − f(0)` (the time of one base chunk with no prefix), and for a prefix of L tokens
choose the chunk x with `f(L + x) − f(L) = T`:

    x = (−B + √(B² + 4aT)) / (2a),   B = 2aL + b

then smooth toward base (`base + σ·(x − base)`), floor at base/4, align down to the block size
and cap by the remaining prompt. Chunks shrink as the prefix grows, so every chunk costs about
the same time on every pipeline stage and the pipeline's bubbles shrink.

Everything here is pure (no torch): `ChunkPlanner.chunks` is the whole plan of one prompt.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

MIN_FIT_POINTS = 3  # a quadratic needs three distinct lengths


@dataclass(frozen=True)
class QuadraticFit:
    """f(l) = a·l² + b·l + c in seconds for l tokens."""

    a: float
    b: float
    c: float

    def __call__(self, length: float) -> float:
        return self.a * length * length + self.b * length + self.c


@dataclass(frozen=True)
class ChunkPlanner:
    """Chooses prefill chunk sizes (tokens).

    base: the configured chunk size (`--chunk-size`, alias `--chunked-prefill-size`), > 0.
    block_size: tokens per KV block; dynamic chunks are aligned down to it.
    fit: the time model, or None for static chunks of `base`.
    smoothing: σ in [0, 1]; 0 = always base, 1 = the raw formula.
    """

    base: int
    block_size: int
    fit: QuadraticFit | None = None
    smoothing: float = 0.75

    def __post_init__(self) -> None:
        if self.base < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {self.base}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.smoothing <= 1.0:
            raise ValueError(f"--dynamic-chunk-smoothing must be in [0, 1], got {self.smoothing}")
        if self.fit is not None and not self.fit.a > 0:
            raise ValueError(f"a dynamic fit needs a > 0, got a={self.fit.a}")

    @property
    def dynamic(self) -> bool:
        return self.fit is not None

    @property
    def target_s(self) -> float:
        """T = f(base) − f(0), seconds (0 for static planning)."""
        return 0.0 if self.fit is None else self.fit(self.base) - self.fit(0)

    def equal_time_chunk(self, prefix: int) -> float:
        """The raw x with f(prefix + x) − f(prefix) = T (before smoothing, floor, alignment)."""
        assert self.fit is not None, "static planning has no time model"
        a, b, t = self.fit.a, self.fit.b, self.target_s
        big_b = 2 * a * prefix + b
        root = math.sqrt(max(big_b * big_b + 4 * a * t, 0.0))
        # (−B + √D) / 2a rewritten as 2T / (B + √D): the same value without the cancellation
        # of −B + √D when B² ≫ 4aT (long prefixes)
        return 2 * t / (big_b + root) if big_b + root > 0 else (-big_b + root) / (2 * a)

    def next_chunk(self, prefix: int, remaining: int) -> int:
        """Tokens of the next chunk after `prefix` computed tokens, with `remaining` (> 0) left.

        Always in [1, min(base, remaining)]; static planning gives min(base, remaining).
        """
        if remaining < 1:
            raise ValueError(f"remaining must be >= 1, got {remaining}")
        if self.fit is None:
            return min(self.base, remaining)
        # never above base: with a fit whose slope at 0 is negative (noisy start-up timings on a
        # busy machine, b < -2a·base) the formula's larger root lies past the curve's minimum
        x = min(self.equal_time_chunk(prefix), self.base)
        x = self.base + self.smoothing * (x - self.base)
        x = max(x, self.base / 4)
        size = int(x) // self.block_size * self.block_size
        # base/4 below one block: keep at least one block so the plan always advances
        size = max(size, min(self.block_size, self.base))
        return max(1, min(size, remaining))

    def chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        """The [s, e) token ranges covering [start, end) in order (empty when start >= end)."""
        out = []
        s = start
        while s < end:
            e = s + self.next_chunk(s, end - s)
            out.append((s, e))
            s = e
        return out


def fit_quadratic(lengths: Sequence[float], seconds: Sequence[float]) -> tuple[QuadraticFit | None, str]:
    """Least-squares fit of f(l) = a·l² + b·l + c to timings (numpy.polyfit).

    Returns (fit, "") when usable, else (None, reason): fewer than MIN_FIT_POINTS distinct
    lengths, a non-finite fit, or a ≤ 0 (no growth with the prefix: dynamic chunks would not
    shrink, so static chunks are as good).
    """
    if len(lengths) != len(seconds):
        raise ValueError(f"{len(lengths)} lengths but {len(seconds)} timings")
    if len(set(lengths)) < MIN_FIT_POINTS:
        return None, f"too few distinct lengths for a quadratic fit ({len(set(lengths))} < {MIN_FIT_POINTS})"
    a, b, c = (float(v) for v in np.polyfit(np.asarray(lengths, float), np.asarray(seconds, float), 2))
    if not all(math.isfinite(v) for v in (a, b, c)):
        return None, f"non-finite fit a={a} b={b} c={c}"
    if a <= 0:
        return None, f"fitted a={a:.3g} <= 0 (time does not grow quadratically with length)"
    return QuadraticFit(a, b, c), ""


def make_planner(base: int, block_size: int, dynamic: bool, smoothing: float,
                 lengths: Sequence[float] = (), seconds: Sequence[float] = ()) -> ChunkPlanner:
    """A planner for the worker's options; with `dynamic`, fit the timings or fall back to
    static chunks with a logged reason."""
    if not dynamic:
        return ChunkPlanner(base, block_size, None, smoothing)
    fit, reason = fit_quadratic(lengths, seconds)
    if fit is None:
        log.warning("dynamic chunking off, static chunks of %d tokens: %s", base, reason)
        return ChunkPlanner(base, block_size, None, smoothing)
    planner = ChunkPlanner(base, block_size, fit, smoothing)
    log.info("dynamic chunking: f(l) = %.3g·l² + %.3g·l + %.3g s; T = %.4f s; first chunks %s", fit.a, fit.b,
             fit.c, planner.target_s, [e - s for s, e in planner.chunks(0, 8 * base)][:8])
    return planner


def profile_lengths(base: int, block_size: int, max_len: int) -> list[int]:
    """Prompt lengths to time at start-up: base × {1/4, 1/2, 1, 2, 4}, block-aligned, capped at
    max_len (distinct, ascending)."""
    out = set()
    for f in (0.25, 0.5, 1, 2, 4):
        n = max(block_size, int(base * f) // block_size * block_size)
        out.add(min(n, max_len))
    return sorted(out)
