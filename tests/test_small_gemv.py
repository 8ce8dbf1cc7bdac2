"""The decode step's GEMV (engine/kernels/small_gemv.py) against its twin: on CUDA in bf16 within
a rounding step (the float32 sum's order differs), in a CUDA graph with programmatic dependent
launch the bits of the eager launch, and in Triton's interpreter in float32 (the interpreter's
bf16 conversions do not round as a GPU does, so bf16 is checked on CUDA only)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.kernels import pdl
from engine.kernels.small_gemv import MAX_ROWS, STEP_MAX_ROWS, gemv, gemv_reference, takes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H100/H200)")
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1 (the kernel on a CPU through Triton's interpreter)")

# (rows, N, K) plain, and (rows, groups, N, K) grouped: config M's q + kv_a, o_proj and W_UV,
# odd sizes, one row of K
PLAIN = [(1, 3648, 2048), (4, 2048, 2048), (2, 37, 300), (3, 5, 1),
         (1, 3647, 2048), (2, 2111, 7000)]  # N not a multiple of the program's rows (8 and 2)
GROUPED = [(1, 16, 128, 512), (4, 16, 128, 512), (2, 3, 7, 40), (4, 2, 127, 512)]


def _pair(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if len(shape) == 3:
        t, n, k = shape
        return (torch.randn(t, k, generator=g).to(dtype).to(device),
                (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device))
    t, grp, n, k = shape
    return (torch.randn(t, grp, k, generator=g).to(dtype).to(device),
            (torch.randn(grp, n, k, generator=g) * 0.05).to(dtype).to(device))


def test_a_cpu_step_keeps_torch_and_bad_shapes_are_refused() -> None:
    x, w = _pair((1, 8, 16), torch.bfloat16, "cpu")
    assert not takes(x, w)  # CPU tensors: F.linear / bmm, the reference path
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.zeros(MAX_ROWS + 1, 16), torch.zeros(8, 16))
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.zeros(1, 16), torch.zeros(8, 15))


@interpreter
@pytest.mark.parametrize("shape", PLAIN + GROUPED)
def test_the_kernel_in_the_interpreter_in_float32(shape) -> None:
    x, w = _pair(shape, torch.float32, "cpu")
    # float32 sums of up to 7,000 products in another order: within 1e-4 (a wrong row is off by O(1))
    torch.testing.assert_close(gemv(x, w), gemv_reference(x, w), rtol=1e-4, atol=1e-4)


@interpreter
def test_nothing_past_the_last_row_is_written_in_the_interpreter() -> None:
    for shape in [(1, 3647, 2048), (2, 3, 127, 512)]:
        x, w = _pair(shape, torch.float32, "cpu")
        want = gemv_reference(x, w)
        flat = torch.full((want.numel() + 64,), 7.0)  # the output and 64 values after it
        out = flat[: want.numel()].view(want.shape)
        gemv(x, w, out=out)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert bool((flat[want.numel():] == 7.0).all())


@interpreter
def test_out_may_be_a_strided_view_in_the_interpreter() -> None:
    x, w = _pair((2, 16, 128, 512), torch.float32, "cpu")
    out = torch.empty(16, 2, 128).transpose(0, 1)  # [T, G, N], rows not contiguous
    assert gemv(x, w, out=out) is out
    torch.testing.assert_close(out, gemv_reference(x, w), rtol=1e-5, atol=1e-5)


def _within_a_rounding_step(got: torch.Tensor, want: torch.Tensor) -> None:
    # one bf16 step of |want| (8 bits of mantissa), plus float32 summation-order noise near 0
    assert got.dtype == want.dtype and got.shape == want.shape
    step = want.float().abs() * 2.0 ** -7 + 1e-3
    assert bool(((got.float() - want.float()).abs() <= step).all())


@cuda
@pytest.mark.parametrize("shape", PLAIN + GROUPED)
def test_the_kernel_on_cuda_is_within_a_rounding_step(shape) -> None:
    x, w = _pair(shape, torch.bfloat16, "cuda")
    assert takes(x, w) == (shape[0] <= STEP_MAX_ROWS)  # 3 and 4 rows: the kernel, not a step's choice
    _within_a_rounding_step(gemv(x, w), gemv_reference(x, w))


@cuda
def test_in_a_graph_with_dependent_launches_it_gives_the_eager_bits() -> None:
    x, w = _pair((1, 2048, 2048), torch.bfloat16, "cuda")
    xg, wg = _pair((1, 16, 128, 512), torch.bfloat16, "cuda", seed=1)
    want = (gemv(x, w), gemv(xg, wg))
    with pdl.dependent_launches("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            gemv(x, w), gemv(xg, wg)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = (gemv(x, w), gemv(xg, wg))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(want, out))


@cuda
def test_the_decode_step_runs_its_projections_through_it(monkeypatch) -> None:
    """A GPU decode step at batch 1 (eager and graphs) sends each attention's q + kv_a, W_UV and
    o_proj through the GEMV, and at batch 2; at batch 4 it keeps torch's (STEP_MAX_ROWS)."""
    from engine.kernels import small_gemv
    from engine.kv_pool import KvPool, KvPoolConfig
    from engine.model_source import TINY, load_model
    from engine.runner import DecodeInput, ModelRunner
    calls = []
    real = small_gemv.gemv
    monkeypatch.setattr(small_gemv, "gemv", lambda x, w, out=None: calls.append(x.shape) or real(x, w, out=out))
    loaded = load_model(TINY, dtype=torch.bfloat16)
    c = loaded.config
    pool = KvPool(KvPoolConfig(num_blocks=64, block_size=16, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                               dtype=torch.bfloat16), 1, "cuda")
    runner = ModelRunner(loaded.model.to("cuda"), pool)
    from engine.model import MLAttention
    attns = [m for m in runner.model.modules() if isinstance(m, MLAttention)][:c.num_hidden_layers]
    # per layer: o_proj and W_UV, and the fused q (or q_a) + kv_a projection where the fast mode fused it
    per_step = sum(2 + (a.fused_a is not None) for a in attns)
    assert len(attns) == c.num_hidden_layers and per_step >= 2 * c.num_hidden_layers
    for lens, want in (([30], per_step), ([3, 40], per_step), ([3, 40, 100, 17], 0)):
        calls.clear()
        tables = [pool.blocks.allocate(pool.blocks_for(n + 1)) for n in lens]
        runner.decode([DecodeInput(t, n, 5) for t, n in zip(tables, lens)])  # eager: no graphs captured
        assert len(calls) == want, (lens, calls[:4])
        for t in tables:
            pool.blocks.free(t)
