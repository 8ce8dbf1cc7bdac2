"""The per-slot add + RMSNorm kernel (engine/kernels/slot_norm.py) against engine.model.add_rms_norm,
its reference: within float32's last bits and one float16 step in Triton's interpreter (whose
bfloat16 casts truncate, so bf16 is checked on CUDA only), within a rounding step in bf16 on
CUDA, the same bits in a CUDA graph as eagerly, and the dispatch's choice."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.kernels import slot_norm
from engine.kernels.slot_norm import add_slots_rms_norm, dispatching, takes
from engine.model import add_rms_norm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1 (the kernel on a CPU through Triton's interpreter)")

SHAPES = [(1, 8, 2048), (4, 8, 2048), (3, 5, 100), (2, 1, 33), (0, 8, 64)]


def _inputs(t: int, slots: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(device)
    delta = torch.randn(t, slots, hidden, generator=g).to(device)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(device)
    return x, delta, w


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_matches_the_reference_in_the_interpreter(dtype) -> None:
    for t, slots, hidden in SHAPES:
        x, delta, w = _inputs(t, slots, hidden, dtype, "cpu")
        got, want = add_slots_rms_norm(x, delta, w, 1e-6), add_rms_norm(x, delta, w, 1e-6)
        for a in got:
            assert a.dtype == dtype and a.shape == (t, hidden)
        # the sums' order (over slots, and the mean square's) and rsqrt may move a float32 value's
        # last bits, and so a float16 value across a rounding edge: within one step of its dtype
        for a, b in zip(got, want):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                torch.testing.assert_close(a, b, rtol=2 ** -10, atol=2 ** -14)
                if a.numel():
                    assert (a != b).float().mean().item() < 0.01  # and nearly all the same bits


@interpreter
def test_two_per_slot_parts_are_summed_as_one_tensor_of_both_slots_in_the_interpreter() -> None:
    # a one-token MoE layer in two branches: routed [T, k, H] and shared [T, S, H]
    for dtype in (torch.float32, torch.float16):
        x, delta, w = _inputs(3, 8, 2048, dtype, "cpu", seed=5)
        routed, shared = delta[:, :6], delta[:, 6:]
        got = add_slots_rms_norm(x, routed, w, 1e-6, shared)
        one = add_slots_rms_norm(x, delta, w, 1e-6)
        plain = add_rms_norm(x, routed, w, 1e-6, shared)
        for a, b, c in zip(got, one, plain):
            assert torch.equal(a, b)  # the same slots in the same order: the same bits
            torch.testing.assert_close(a, c, rtol=1e-5 if dtype == torch.float32 else 2 ** -10,
                                       atol=1e-6 if dtype == torch.float32 else 2 ** -14)


def test_the_plain_sum_of_two_per_slot_parts_is_the_one_tensor_sum() -> None:
    x, delta, w = _inputs(2, 8, 64, torch.bfloat16, "cpu", seed=6)
    for a, b in zip(add_rms_norm(x, delta[:, :6], w, 1e-6, delta[:, 6:]), add_rms_norm(x, delta, w, 1e-6)):
        assert torch.equal(a, b)


def test_shapes_it_does_not_take_are_refused_or_passed_on() -> None:
    x, delta, w = _inputs(2, 3, 16, torch.float32, "cpu")
    assert not takes(x, delta, None)  # a CPU tensor: the plain function runs
    calls = []
    f = dispatching(lambda *a: calls.append(a) or add_rms_norm(*a))
    for a, b in zip(f(x, delta, w, 1e-6), add_rms_norm(x, delta, w, 1e-6)):
        assert torch.equal(a, b)
    assert len(calls) == 1
    if slot_norm.triton is None:
        return
    with pytest.raises(ValueError, match="add_slots_rms_norm takes"):
        add_slots_rms_norm(x, delta[:, :, :8], w, 1e-6)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_on_cuda_is_within_a_rounding_step(dtype) -> None:
    for t, slots, hidden in SHAPES + [(64, 8, 2048), (2, 8, 4096), (2, 9, 7168)]:
        x, delta, w = _inputs(t, slots, hidden, dtype, "cuda")
        # (a row past MAX_ROW_VALUES is left to the compiled function; the kernel still runs it, spilling)
        assert takes(x, delta, None) == ((1 << (hidden - 1).bit_length()) * slots <= slot_norm.MAX_ROW_VALUES)
        got, want = add_slots_rms_norm(x, delta, w, 1e-6), add_rms_norm(x, delta, w, 1e-6)
        for a, b in zip(got, want):
            # the sums' order may move a value by one step of its dtype (bf16: 2^-8 relative)
            step = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}[dtype]
            torch.testing.assert_close(a.float(), b.float(), rtol=step, atol=step)
            if a.numel() and dtype != torch.float32:  # float32 keeps every order difference's last bit
                assert (a != b).float().mean().item() < 0.01, "more than 1 % of the values off"


@cuda
def test_the_dispatch_takes_per_slot_deltas_only() -> None:
    x, delta, w = _inputs(2, 8, 64, torch.bfloat16, "cuda")
    assert takes(x, delta, None)
    assert not takes(x, delta.sum(1).to(x.dtype), None)  # a [T, hidden] delta: the compiled function
    assert not takes(x, delta, x)  # a [T, hidden] shared part beside it: the compiled function
    assert takes(x, delta[:, :6], delta[:, 6:])  # both per slot (a one-token MoE in two branches)
    two = add_slots_rms_norm(x, delta[:, :6], w, 1e-6, delta[:, 6:])
    assert all(torch.equal(a, b) for a, b in zip(two, add_slots_rms_norm(x, delta, w, 1e-6)))
    assert not takes(x, delta.half(), None)
    assert takes(x, delta, None, w) and not takes(x, delta, None, w.float())  # a float32 weight promotes: compiled
    wide, wide_delta, _ = _inputs(1, 8, 7168, torch.bfloat16, "cuda")  # a row past MAX_ROW_VALUES: compiled
    assert not takes(wide, wide_delta, None)


@cuda
def test_the_kernel_in_a_cuda_graph_gives_the_eager_bits() -> None:
    x, delta, w = _inputs(4, 8, 2048, torch.bfloat16, "cuda")
    eager = add_slots_rms_norm(x, delta, w, 1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = add_slots_rms_norm(x, delta, w, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
