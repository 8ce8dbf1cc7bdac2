"""Property tests of the prefill chunk planner (engine/chunking.py)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.chunking import ChunkPlanner, QuadraticFit, fit_quadratic, make_planner, profile_lengths

fits = st.builds(QuadraticFit, a=st.floats(1e-12, 1e-5), b=st.floats(1e-6, 1e-2), c=st.floats(0, 0.1))
block_sizes = st.sampled_from([1, 4, 16, 64])


@st.composite
def planners(draw, dynamic=True):
    bs = draw(block_sizes)
    base = draw(st.integers(1, 64)) * bs
    return ChunkPlanner(base, bs, draw(fits) if dynamic else None, draw(st.floats(0.0, 1.0)))


@settings(max_examples=200, deadline=None)
@given(p=st.one_of(planners(True), planners(False)), start=st.integers(0, 5000), n=st.integers(1, 20000))
def test_chunks_cover_the_prompt_in_order(p, start, n):
    chunks = p.chunks(start, start + n)
    assert chunks[0][0] == start and chunks[-1][1] == start + n
    for (s0, e0), (s1, _) in zip(chunks, chunks[1:]):
        assert e0 == s1
    assert all(1 <= e - s <= max(p.base, p.block_size) for s, e in chunks)


@settings(max_examples=100, deadline=None)
@given(p=planners(False), n=st.integers(1, 10000))
def test_static_chunks_are_base(p, n):
    sizes = [e - s for s, e in p.chunks(0, n)]
    assert all(x == p.base for x in sizes[:-1]) and 1 <= sizes[-1] <= p.base


@settings(max_examples=200, deadline=None)
@given(p=planners(True), n=st.integers(1, 50000))
def test_dynamic_chunks_shrink_are_aligned_and_floored(p, n):
    sizes = [e - s for s, e in p.chunks(0, n)]
    full = sizes[:-1]  # the last chunk is capped by the remaining prompt
    assert all(x % p.block_size == 0 for x in full)
    assert all(x >= min(p.block_size, p.base) and x >= p.base // 4 // p.block_size * p.block_size for x in full)
    assert all(a >= b for a, b in zip(full, full[1:]))  # f is convex: later chunks are never larger


@settings(max_examples=200, deadline=None)
@given(fit=fits, base=st.integers(1, 4096), prefix=st.integers(0, 200000))
def test_equal_time_chunk_solves_the_design_equation(fit, base, prefix):
    p = ChunkPlanner(base, 1, fit, 1.0)
    x = p.equal_time_chunk(prefix)
    assert x == pytest.approx(base) if prefix == 0 else x <= base + 1e-6 * base
    # f(L + x) − f(L) = a(2Lx + x²) + bx, written out to avoid cancellation in the check itself
    assert fit.a * (2 * prefix * x + x * x) + fit.b * x == pytest.approx(p.target_s, rel=1e-6)


def test_smoothing_and_floor_by_hand():
    # f = l² (a=1, b=c=0), base 64: T = 4096; prefix 1000 -> x = -1000 + sqrt(1000² + 4096) = 2.046
    p = ChunkPlanner(64, 4, QuadraticFit(1.0, 0.0, 0.0), 0.75)
    assert p.next_chunk(0, 10_000) == 64
    # smoothed 64 + 0.75 (2.046 - 64) = 17.53 -> floor 16 -> aligned 16
    assert p.next_chunk(1000, 10_000) == 16
    # far prefix: smoothed 16.0x, aligned 16; base/4 = 16 is the floor
    assert p.next_chunk(10**9, 10_000) == 16
    assert p.next_chunk(1000, 5) == 5  # capped by the remaining prompt
    raw = ChunkPlanner(64, 1, QuadraticFit(1.0, 0.0, 0.0), 1.0)
    assert raw.next_chunk(1000, 10_000) == 16  # floor base/4


@settings(max_examples=50, deadline=None)
@given(a=st.floats(1e-9, 1e-5), b=st.floats(1e-5, 1e-2), c=st.floats(0, 1))
def test_fit_recovers_coefficients(a, b, c):
    lengths = [64, 128, 256, 512, 1024]
    fit, reason = fit_quadratic(lengths, [a * n * n + b * n + c for n in lengths])
    assert reason == "" and fit is not None
    assert fit.a == pytest.approx(a, rel=1e-3) and fit.b == pytest.approx(b, rel=1e-3, abs=1e-9)


def test_fallback_to_static_with_a_reason(caplog):
    fit, reason = fit_quadratic([64, 128], [0.1, 0.2])
    assert fit is None and "too few" in reason
    fit, reason = fit_quadratic([64, 128, 256, 512], [1.0 - 1e-4 * n * n / 512 for n in (64, 128, 256, 512)])
    assert fit is None and "<= 0" in reason
    with caplog.at_level(logging.WARNING, logger="engine.chunking"):
        p = make_planner(128, 16, True, 0.75, [64, 128, 256], [0.1, 0.2, 0.25])
    assert not p.dynamic and "dynamic chunking off" in caplog.text
    assert make_planner(128, 16, True, 0.75, [64, 128, 256], [0.1, 0.25, 0.7]).dynamic


def test_bad_options_name_the_flag():
    with pytest.raises(ValueError, match="chunk-size"):
        ChunkPlanner(0, 16)
    with pytest.raises(ValueError, match="dynamic-chunk-smoothing"):
        ChunkPlanner(64, 16, None, 1.5)


def test_profile_lengths():
    assert profile_lengths(256, 16, 100_000) == [64, 128, 256, 512, 1024]
    assert profile_lengths(256, 16, 300) == [64, 128, 256, 300]


def test_a_fit_falling_at_zero_never_gives_chunks_above_base():
    # timings from a busy machine: a > 0 but b < -2a·base, so f(x) - f(0) = T has its larger
    # root far past base (the start-up fit of tests/test_e2e_prefill_pipeline.py once gave 160
    # for a base of 64)
    fit = QuadraticFit(a=1e-6, b=-2e-4, c=0.05)
    planner = ChunkPlanner(64, 16, fit, 0.75)
    sizes = [e - s for s, e in planner.chunks(0, 4096)]
    assert max(sizes) <= 64 and sum(sizes) == 4096
