"""The split prefill attention (engine/kernels/prefill_attention.py) against the masked SDPA of
`engine.model.mla_attention`'s reference path: the log-sum-exp merge on any device, the cuDNN /
flash kernels on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.prefill_attention import merge, prefix_causal_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")


def _lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    t, s = q.shape[2], k.shape[2]
    mask = torch.arange(s, device=q.device)[None, :] <= torch.arange(s - t, s, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _attn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scale * q @ k.transpose(-1, -2)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def test_merge_of_two_key_sets_is_attention_over_their_union() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 7, 16, generator=g)
    k = torch.randn(1, 3, 20, 16, generator=g) * 3  # large scores: the max shift matters
    v = torch.randn(1, 3, 20, 8, generator=g)
    o1, l1 = _attn_lse(q, k[:, :, :13], v[:, :, :13], 0.25)
    o2, l2 = _attn_lse(q, k[:, :, 13:], v[:, :, 13:], 0.25)
    want, _ = _attn_lse(q, k, v, 0.25)
    want_lse = torch.logsumexp(0.25 * q @ k.transpose(-1, -2), -1)
    got, got_lse = merge(o1, l1, o2, l2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    # one side far below the other (its weight underflows to 0): no NaN, the other side wins
    got, _ = merge(o1, l1 - 1e4, o2, l2)
    torch.testing.assert_close(got, o2, atol=1e-6, rtol=0)


@cuda
@pytest.mark.parametrize("t,s", [(2, 2), (7, 7), (64, 200), (300, 1000), (129, 4096), (1024, 1024), (2100, 2100), (2100, 7100), (2048, 10240)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefix_causal_attention_matches_masked_sdpa(t: int, s: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(t * 7 + s)
    h, qk, dv = 4, 192, 128  # MLA's head sizes (q/k nope 128 + rope 64, v 128)
    q = torch.randn(1, h, t, qk, device="cuda", generator=g)
    k = torch.randn(1, h, s, qk, device="cuda", generator=g)
    v = torch.randn(1, h, s, dv, device="cuda", generator=g)
    scale = qk ** -0.5
    want = _lower_right(q, k, v, scale)  # float32 reference
    got = prefix_causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale)
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.float() - want).abs().max().item()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert err < tol, err


@cuda
def test_mla_attention_bf16_on_cuda_matches_the_cpu_float32_path() -> None:
    from engine.model import mla_attention
    g = torch.Generator().manual_seed(3)
    h, nope, rope, rank, dv, t, s = 4, 128, 64, 512, 128, 96, 640
    q_nope, q_pe = torch.randn(t, h, nope, generator=g), torch.randn(t, h, rope, generator=g)
    latent = torch.randn(s, rank + rope, generator=g)
    kv_b = torch.randn(h * (nope + dv), rank, generator=g) * rank ** -0.5
    pos = torch.arange(s - t, s)
    args = (rank, dv, (nope + rope) ** -0.5)
    want = mla_attention(q_nope, q_pe, latent, pos, kv_b, *args)
    got = mla_attention(*(x.cuda().bfloat16() for x in (q_nope, q_pe, latent)), pos.cuda(),
                        kv_b.cuda().bfloat16(), *args)
    rel = (got.float().cpu() - want).norm() / want.norm()
    assert rel < 2e-2, rel.item()


@cuda
def test_fused_experts_sort_above_the_one_program_limit_equals_below() -> None:
    """Past ALIGN_ONE_PROGRAM_MAX_PAIRS the pairs are sorted by torch: same result."""
    from engine.kernels import fused_moe
    g = torch.Generator(device="cuda").manual_seed(5)
    e, hidden, inter, k = 16, 256, 128, 4
    gate_up = torch.randn(e, 2 * inter, hidden, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    down = torch.randn(e, hidden, inter, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    t = fused_moe.ALIGN_ONE_PROGRAM_MAX_PAIRS // k + 50
    x = torch.randn(t, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.randint(0, e, (t, k), device="cuda", generator=g)
    w = torch.rand(t, k, device="cuda", generator=g)
    got = fused_moe.fused_experts(x, ids, w, gate_up, down)
    want = fused_moe.fused_experts_reference(x, ids, w, gate_up, down)
    assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2
