"""The split prefill attention (engine/kernels/prefill_attention.py) against the masked SDPA of
`engine.model.mla_attention`'s reference path: the log-sum-exp merge on any device, the cuDNN /
flash kernels on CUDA."""

from __future__ import annotations

import dataclasses

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


def _pool_with_sequences(device: str, dtype: torch.dtype, lens: list[tuple[int, int]], block: int = 16):
    """A pool of random latents and PagedKvCache over sequences (prefix, q_len) with scattered
    block tables; returns (pool, kv, the new tokens' latents [T, kv_dim] in the pool's layer 0)."""
    from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache
    kv_dim = 512 + 64
    need = sum(-(-(p + n) // block) for p, n in lens)
    pool = KvPool(KvPoolConfig(need + 8, block, 2, kv_dim, dtype=dtype), 1, device=device)
    g = torch.Generator().manual_seed(len(lens))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(pool.kv.dtype))
    ids = torch.randperm(need + 8, generator=g).tolist()  # scattered, not in order
    seqs, at = [], 0
    for p, n in lens:
        nb = -(-(p + n) // block)
        seqs.append((ids[at:at + nb], p, n))
        at += nb
    kv = PagedKvCache(pool, seqs, pack=True)
    latent = torch.randn(sum(n for _, n in lens), kv_dim, generator=g).to(device)
    return pool, kv, latent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_packed_contexts_hold_each_sequence_context(dtype: torch.dtype) -> None:
    """`PagedKvCache.packed` (what the varlen call reads) against `context`, sequence by
    sequence: rows cu_k[j] .. cu_k[j] + used_k[j] are sequence j's context, its queries rows
    cu_q[j] .. cu_q[j+1] of `q_index` (every chunk's rows when all are packed)."""
    lens = [(0, 5), (40, 7), (3, 30), (16, 16), (0, 1)]
    _, kv, latent = _pool_with_sequences("cpu", dtype, lens)
    kv.write(1, latent)
    like = torch.empty(0)
    which = [1, 2, 4]
    ctx = kv.packed(1, which, like)
    starts = [0]
    for _, n in lens:
        starts.append(starts[-1] + n)
    q_rows = ctx.q_index.tolist()
    for j, i in enumerate(which):
        p, n = lens[i]
        lo, used = int(ctx.cu_k[j]), int(ctx.used_k[j])
        assert used == p + n and int(ctx.cu_k[j + 1]) - lo == -(-used // 16) * 16
        assert torch.equal(ctx.rows[lo:lo + used], kv.context(1, i, like))
        assert q_rows[ctx.q_offsets[j]:ctx.q_offsets[j + 1]] == list(range(starts[i], starts[i] + n))
        assert int(ctx.cu_q[j + 1]) - int(ctx.cu_q[j]) == n
    assert ctx.max_q == 30 and ctx.max_k == 47
    assert kv.packed(0, range(len(lens)), like).q_index is None  # all of them: the queries as they are


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_packed_prefill_attention_matches_per_sequence(dtype: torch.dtype) -> None:
    """A prefill batch's attention with the short chunks in one varlen call (and a long one
    through cuDNN) against `mla_attention` sequence by sequence, the reference path."""
    from engine.config import ModelConfig
    from engine.model import MLAttention, mla_attention
    lens = [(0, 37), (300, 64), (1000, 1), (17, 2100), (5000, 700), (0, 2)]  # (cached prefix, chunk)
    _, kv, latent = _pool_with_sequences("cuda", dtype, lens)
    cfg = dataclasses.replace(ModelConfig.tiny(), hidden_size=256, num_attention_heads=4, q_lora_rank=None,
                              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    attn = MLAttention(cfg).cuda().bfloat16()
    torch.nn.init.normal_(attn.kv_b_proj.weight, std=512 ** -0.5)
    g = torch.Generator(device="cuda").manual_seed(11)
    t = sum(n for _, n in lens)
    q_nope = torch.randn(t, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    q_pe = torch.randn(t, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(p, p + n) for p, n in lens]).cuda()
    kv.write(0, latent.bfloat16())
    got = attn._packed_attention(q_nope, q_pe, positions, [n for _, n in lens], kv, 0)
    start = 0
    for i, (p, n) in enumerate(lens):
        sl = slice(start, start + n)
        ctx = kv.context(0, i, q_nope).float()
        want = mla_attention(q_nope[sl].float(), q_pe[sl].float(), ctx, positions[sl],
                             attn.kv_b_proj.weight.float(), 512, 128, attn.softmax_scale)
        rel = ((got[sl].float() - want).norm() / want.norm()).item()
        assert rel < 2e-2, (i, p, n, rel)
        start += n


@pytest.mark.parametrize("max_rows", [32768, 64])
def test_packed_attention_with_the_reference_kernel_equals_per_sequence(monkeypatch, max_rows: int) -> None:
    """The model's packed prefill attention (short chunks packed, a long one apart, pieces put
    back in batch order) with the varlen kernel replaced by its reference twin, in float32 on a
    CPU: the per-sequence `mla_attention` results. max_rows 64: the short chunks split over
    several calls, the first two exactly at the cap and a context above it in a call alone."""
    from engine.config import ModelConfig
    from engine.kernels import prefill_attention
    from engine.model import MLAttention, mla_attention
    monkeypatch.setattr(prefill_attention, "varlen_causal_attention",
                        prefill_attention.varlen_causal_attention_reference)
    monkeypatch.setattr(prefill_attention, "PACK_MAX_ROWS", max_rows)
    calls = []
    real = prefill_attention.varlen_causal_attention_reference
    monkeypatch.setattr(prefill_attention, "varlen_causal_attention",
                        lambda q, k, *a: calls.append(k.shape[0]) or real(q, k, *a))
    lens = [(0, 5), (33, 2050), (40, 7), (3, 1), (16, 16), (80, 3)]
    _, kv, latent = _pool_with_sequences("cpu", torch.float32, lens)
    cfg = dataclasses.replace(ModelConfig.tiny(), hidden_size=64, num_attention_heads=2, q_lora_rank=None,
                              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    attn = MLAttention(cfg)
    g = torch.Generator().manual_seed(2)
    torch.nn.init.normal_(attn.kv_b_proj.weight, std=512 ** -0.5, generator=g)
    t = sum(n for _, n in lens)
    q_nope, q_pe = torch.randn(t, 2, 128, generator=g), torch.randn(t, 2, 64, generator=g)
    positions = torch.cat([torch.arange(p, p + n) for p, n in lens])
    kv.write(0, latent)
    with torch.no_grad():
        got = attn._packed_attention(q_nope, q_pe, positions, [n for _, n in lens], kv, 0)
        start = 0
        for i, (_, n) in enumerate(lens):
            sl = slice(start, start + n)
            want = mla_attention(q_nope[sl], q_pe[sl], kv.context(0, i, q_nope), positions[sl],
                                 attn.kv_b_proj.weight, 512, 128, attn.softmax_scale)
            torch.testing.assert_close(got[sl], want, atol=2e-5, rtol=2e-5)
            start += n
    # context rows in whole blocks: 16, 48, 16, 32 and 96 for the five short chunks
    assert calls == ([208] if max_rows > 1000 else [16 + 48, 16 + 32, 96]), calls


def test_packed_refuses_unordered_or_repeated_sequences() -> None:
    _, kv, _ = _pool_with_sequences("cpu", torch.float32, [(0, 5), (3, 4)])
    like = torch.empty(0)
    for bad in ([1, 0], [0, 0], [], [2]):
        with pytest.raises(ValueError, match="strictly ascending"):
            kv.packed(0, bad, like)


@cuda
def test_varlen_causal_attention_matches_its_reference() -> None:
    """The FlashAttention-2 varlen call, with key rows past each sequence's used ones (a last
    block's padding), against the masked per-sequence reference."""
    from engine.kernels.prefill_attention import varlen_causal_attention, varlen_causal_attention_reference
    g = torch.Generator(device="cuda").manual_seed(9)
    seqs = [(5, 5), (1, 300), (64, 64), (200, 1000), (3, 17)]  # (queries, used keys)
    pad = 13
    cu_q, cu_k, used = [0], [0], []
    for t, s in seqs:
        cu_q.append(cu_q[-1] + t)
        cu_k.append(cu_k[-1] + s + pad)
        used.append(s)
    h = 4
    q = torch.randn(cu_q[-1], h, 192, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(cu_k[-1], h, 192, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(cu_k[-1], h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    args = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in (cu_q, cu_k, used)]
    got = varlen_causal_attention(q, k, v, *args, max(t for t, _ in seqs), max(used), 192 ** -0.5)
    want = varlen_causal_attention_reference(q.float(), k.float(), v.float(), *args, 0, 0, 192 ** -0.5)
    assert got.shape == (cu_q[-1], h, 128)
    assert (got.float() - want).abs().max().item() < 2e-2
