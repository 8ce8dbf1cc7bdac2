"""The decode step's latent write + query rope (engine/kernels/latent_store.py).

On a CPU: the plain twin writes exactly the token's (block, layer, offset) rows, the values of
`rope_latent`, saturated in FP8 pools; with `TRITON_INTERPRET=1` and triton installed, the
kernel itself in float32 through Triton's interpreter (its bf16 casts truncate, so float32
only). On CUDA: the Triton kernel against the twin in bf16 and
FP8, on the views the decode step passes (slices of one fused projection output), at config M's
and DeepSeek-V3's head counts and at 1 to 300 tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.kernels.latent_store import rope_latent_store, rope_latent_store_reference
from engine.kv_pool import FP8, reciprocal32
from engine.model import rope_cos_sin, rope_latent

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or __import__("importlib").util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1 (the kernel on a CPU through Triton's interpreter)")


def _inputs(t: int, h: int, rank: int, rope: int, dtype: torch.dtype, device: str, seed: int = 0):
    """q_pe and kv_a as views of one [T, H * (128 + rope) + rank + rope] projection output (the
    decode step's fused q_proj / kv_a_proj_with_mqa GEMM), cos / sin at positions 1,000.., a norm
    weight and write slots (distinct blocks where there are enough)."""
    g = torch.Generator().manual_seed(seed)
    qk = 128 + rope
    out = (torch.randn(t, h * qk + rank + rope, generator=g) * 2).to(dtype).to(device)
    q_pe = out[:, : h * qk].view(t, h, qk)[..., 128:]
    kv_a = out[:, h * qk:]
    cos, sin = rope_cos_sin(torch.arange(1000, 1000 + t, device=device), rope, 10000.0, dtype)
    weight = (torch.rand(rank, generator=g) + 0.5).to(dtype).to(device)
    blocks = max(t, 4) + 3
    w_blk = torch.randperm(blocks, generator=g)[:t].to(device)
    w_off = torch.randint(0, 16, (t,), generator=g).to(device)
    return q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off


def test_reference_writes_the_tokens_rows_and_saturates_fp8() -> None:
    t, h, rank, rope = 5, 3, 32, 16
    q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off = _inputs(t, h, rank, rope, torch.float32, "cpu")
    want_q, latent = rope_latent(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True)
    kv = torch.full((blocks, 3, 16, rank + rope), 7.0)
    got_q = rope_latent_store_reference(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv, 2, w_blk, w_off)
    assert torch.equal(got_q, want_q) and got_q.is_contiguous()
    assert torch.equal(kv[w_blk, 2, w_off], latent)
    kv[w_blk, 2, w_off] = 7.0
    assert bool((kv == 7.0).all()), "a row other than the tokens' was written"
    # FP8: latent / scale, values beyond e4m3's range saturated (a plain cast would give NaN)
    kv8 = torch.zeros((blocks, 3, 16, rank + rope), dtype=FP8)
    scale = 1e-3
    rope_latent_store_reference(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv8, 0, w_blk, w_off, scale)
    stored = kv8[w_blk, 0, w_off].float()
    fmax = torch.finfo(FP8).max
    assert not stored.isnan().any()
    big = (latent / scale).abs() > fmax
    assert big.any() and bool((stored[big].abs() == fmax).all())
    assert torch.equal(stored[~big], (latent * reciprocal32(scale))[~big].to(FP8).float())
    # one multiplier for every FP8 write: float32(1) / float32(scale), not 1 / scale in double
    assert reciprocal32(1.1) == float(torch.tensor(1.0) / torch.tensor(1.1)) != float(torch.tensor(1 / 1.1))


def _within_a_step(got: torch.Tensor, exact: torch.Tensor, rel_step: float, min_step: float) -> None:
    """Every value within one step of the stored dtype (rel_step = 2^-mantissa bits of the
    exact value's binade; at least min_step, the subnormal step) of the exact value."""
    got, exact = got.double(), exact.double()
    step = (torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-300)))) * rel_step).clamp_min(min_step)
    worst = ((got - exact).abs() / step).max().item()
    assert worst <= 1.0, worst


@cuda
@pytest.mark.parametrize("h,fp8", [(16, False), (16, True), (128, False), (5, True)])
@pytest.mark.parametrize("t,layer", [(1, 0), (64, 1), (300, 17)])  # layers: Triton specialises 1 and multiples of 16
@pytest.mark.parametrize("interleave", [True, False])
def test_kernel_equals_its_twin(h: int, fp8: bool, t: int, layer: int, interleave: bool) -> None:
    rank, rope = 512, 64
    q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off = _inputs(t, h, rank, rope, torch.bfloat16, "cuda", seed=t)
    # 1.1: a scale whose float32 reciprocal differs from the double one rounded to float32
    dtype, scale = (FP8, 1.1) if fp8 else (torch.bfloat16, 1.0)
    kv_want = torch.randn((blocks, 18, 16, rank + rope), device="cuda").to(dtype)  # a stray write shows
    kv_got = kv_want.clone()
    rope_latent_store_reference(q_pe, kv_a, cos, sin, weight, 1e-6, rank, interleave, kv_want, layer,
                                w_blk, w_off, scale)  # (its pool: the norm's rows, and no other row written)
    got = rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, rank, interleave, kv_got, layer, w_blk, w_off, scale)
    # the ropes: float32 math rounded once (as the compiled rope_latent the served step ran
    # before), so within one step of the stored dtype of the exact value everywhere; the eager
    # twin rounds each product too, so it may be further off where the two products cancel
    exact_q, exact_latent = rope_latent(q_pe.double(), kv_a.double(), cos.double(), sin.double(),
                                        weight.double(), 1e-6, rank, interleave)
    _within_a_step(got, exact_q, 2.0 ** -7, 2.0 ** -133)
    a, b = kv_want.float(), kv_got.float()
    k_exact = exact_latent[:, rank:] * (reciprocal32(scale) if fp8 else 1.0)
    fmax = torch.finfo(FP8).max
    _within_a_step(b[w_blk, layer, w_off, rank:], k_exact.clamp(-fmax, fmax) if fp8 else k_exact,
                   2.0 ** -3 if fp8 else 2.0 ** -7, 2.0 ** -9 if fp8 else 2.0 ** -133)
    # the norm: float32, rounded to the model dtype before the weight (rms_norm's explicit cast),
    # then once more: within two steps of the exact value (the eager twin: up to 1.41 on a CPU)
    n_exact = exact_latent[:, :rank] * (reciprocal32(scale) if fp8 else 1.0)
    _within_a_step(b[w_blk, layer, w_off, :rank], n_exact.clamp(-fmax, fmax) if fp8 else n_exact,
                   2.0 ** -2 if fp8 else 2.0 ** -6, 2.0 ** -8 if fp8 else 2.0 ** -132)
    _within_a_step(a[w_blk, layer, w_off, :rank], n_exact.clamp(-fmax, fmax) if fp8 else n_exact,
                   2.0 ** -2 if fp8 else 2.0 ** -6, 2.0 ** -8 if fp8 else 2.0 ** -132)  # (the twin too)
    a[w_blk, layer, w_off] = 0.0
    b[w_blk, layer, w_off] = 0.0
    assert torch.equal(a, b), "a row other than the tokens' was written"


@cuda
def test_kernel_takes_no_tokens_and_keeps_nan() -> None:
    q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off = _inputs(2, 16, 512, 64, torch.bfloat16, "cuda")
    kv = torch.zeros((blocks, 2, 16, 576), device="cuda").to(FP8)
    empty = rope_latent_store(q_pe[:0], kv_a[:0], cos[:0], sin[:0], weight, 1e-6, 512, True, kv, 0, w_blk[:0], w_off[:0])
    assert empty.shape == (0, 16, 64) and not kv.float().any()
    kv_a = kv_a.clone()
    kv_a[0, 3] = float("nan")  # a poisoned latent stays NaN in an FP8 pool (the twin's clamp keeps it)
    rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, 512, True, kv, 1, w_blk, w_off, 1.1)
    assert kv[w_blk[0], 1, w_off[0], :512].float().isnan().all()
    assert not kv[w_blk[1], 1, w_off[1]].float().isnan().any()


@interpreter
@pytest.mark.parametrize("t,h,rank,rope,interleave", [(1, 16, 512, 64, True), (5, 16, 512, 64, False),
                                                      (3, 3, 24, 12, True), (2, 128, 512, 64, True)])
def test_kernel_in_the_interpreter(t: int, h: int, rank: int, rope: int, interleave: bool) -> None:
    """float32: the ropes bit for bit, the norm within a float32 rounding step, no other row."""
    q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off = _inputs(t, h, rank, rope, torch.float32, "cpu", seed=t)
    kv_want = torch.randn((blocks, 3, 16, rank + rope))
    kv_got = kv_want.clone()
    want = rope_latent_store_reference(q_pe, kv_a, cos, sin, weight, 1e-6, rank, interleave, kv_want, 2,
                                       w_blk, w_off)
    got = rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, rank, interleave, kv_got, 2, w_blk, w_off)
    assert torch.equal(got, want)
    assert torch.equal(kv_want[..., rank:], kv_got[..., rank:])
    assert torch.allclose(kv_want, kv_got, rtol=1e-6, atol=0)  # the norm: a few float32 ulps
    kv_want[w_blk, 2, w_off] = 0.0
    kv_got[w_blk, 2, w_off] = 0.0
    assert torch.equal(kv_want, kv_got), "a row other than the tokens' was written"


def _absorb_inputs(q_pe: torch.Tensor, rank: int, dtype: torch.dtype, device: str, seed: int = 0):
    """q_nope as the view the decode step passes (the first 128 of each head's row, beside q_pe in
    the same projection output) and w_uk as a view of a kv_b_proj weight [H · (128 + 128), R]."""
    t, h, _ = q_pe.shape
    g = torch.Generator().manual_seed(seed + 7)
    q_nope = q_pe.as_strided((t, h, 128), q_pe.stride(), q_pe.storage_offset() - 128)  # the same rows, 128 back
    kv_b = (torch.randn(h * 256, rank, generator=g) / rank ** 0.5).to(dtype).to(device)
    w_uk = kv_b.view(h, 256, rank)[:, :128]
    return q_nope, w_uk


@interpreter
@pytest.mark.parametrize("t,h,rank", [(1, 16, 512), (5, 3, 24), (17, 16, 512), (33, 2, 200)])
def test_absorbed_query_in_the_same_launch_in_the_interpreter(t: int, h: int, rank: int) -> None:
    """float32: q_lat within float32 summation order of the einsum it replaces; the rope and the
    pool as without it."""
    q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off = _inputs(t, h, rank, 64, torch.float32, "cpu", seed=t)
    q_nope, w_uk = _absorb_inputs(q_pe, rank, torch.float32, "cpu")
    kv_plain = torch.randn((blocks, 3, 16, rank + 64))
    kv_absorb = kv_plain.clone()
    q_plain = rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv_plain, 2, w_blk, w_off)
    q_got, lat = rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv_absorb, 2, w_blk, w_off,
                                   q_nope=q_nope, w_uk=w_uk)
    assert torch.equal(q_got, q_plain) and torch.equal(kv_absorb, kv_plain)
    want = rope_latent_store_reference(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv_plain.clone(), 2,
                                       w_blk, w_off, q_nope=q_nope, w_uk=w_uk)[1]
    assert lat.shape == (t, h, rank) and lat.is_contiguous()
    torch.testing.assert_close(lat, want, rtol=1e-5, atol=1e-5)


def test_absorbed_query_shapes_are_checked() -> None:
    if __import__("importlib").util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off = _inputs(2, 3, 24, 8, torch.float32, "cpu")
    q_nope, w_uk = _absorb_inputs(q_pe, 24, torch.float32, "cpu")
    kv = torch.zeros((blocks, 1, 16, 32))
    with pytest.raises(ValueError, match="need q_nope"):
        rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, 24, True, kv, 0, w_blk, w_off,
                          q_nope=q_nope, w_uk=w_uk[:2])
    with pytest.raises(ValueError, match="q_nope and w_uk go together"):
        rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, 24, True, kv, 0, w_blk, w_off, q_nope=q_nope)
    with pytest.raises(ValueError, match="unit stride along R"):
        rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, 24, True, kv, 0, w_blk, w_off,
                          q_nope=q_nope, w_uk=w_uk.transpose(1, 2).contiguous().transpose(1, 2))


@cuda
@pytest.mark.parametrize("t,h", [(1, 16), (4, 16), (64, 16), (300, 128), (3, 5)])
@pytest.mark.parametrize("fp8", [False, True])
def test_absorbed_query_on_cuda(t: int, h: int, fp8: bool) -> None:
    """bf16: q_lat within a bf16 rounding step or two of the einsum (float32 sums in either,
    in another order); the rope and the pool exactly as without it."""
    rank = 512
    q_pe, kv_a, cos, sin, weight, blocks, w_blk, w_off = _inputs(t, h, rank, 64, torch.bfloat16, "cuda", seed=t)
    q_nope, w_uk = _absorb_inputs(q_pe, rank, torch.bfloat16, "cuda")
    dtype, scale = (FP8, 1.1) if fp8 else (torch.bfloat16, 1.0)
    kv_plain = torch.randn((blocks, 3, 16, rank + 64), device="cuda").to(dtype)
    kv_absorb = kv_plain.clone()
    q_plain = rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv_plain, 2, w_blk, w_off, scale)
    q_got, lat = rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv_absorb, 2, w_blk, w_off,
                                   scale, q_nope=q_nope, w_uk=w_uk)
    assert torch.equal(q_got, q_plain) and torch.equal(kv_absorb.float(), kv_plain.float())
    want = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    torch.testing.assert_close(lat.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert (lat != want).float().mean().item() < 0.05
    graph = torch.cuda.CUDAGraph()  # in a graph: the eager bits
    with torch.cuda.graph(graph):
        _, lat_g = rope_latent_store(q_pe, kv_a, cos, sin, weight, 1e-6, rank, True, kv_absorb, 2, w_blk, w_off,
                                     scale, q_nope=q_nope, w_uk=w_uk)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lat_g, lat)
