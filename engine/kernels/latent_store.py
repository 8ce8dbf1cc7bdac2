"""A decode step's per-layer latent write and query rope in one Triton kernel.

Before a layer's MLA decode attention, each new token needs, from kv_a_proj_with_mqa's output
kv_a [T, R + P] (c_kv then k_pe) and its query's rope part q_pe [T, H, P]:

    latent = (RMSNorm(c_kv) · kv_a_layernorm.weight, rope(k_pe))      -> the pool row of (token, layer)
    q_pe   = rope(q_pe)                                                -> the attention's query

`engine.model.rope_latent` computes the two, and the decode step then wrote the latent with an
index_put: on a GPU that was four kernels a layer (the compiled rope_latent's three and the
index kernel; 8.2 µs of config M's batch-1 step per layer and 12.6 µs at batch 64 on an H200,
docs/bench/profile_decode_M_run17.jsonl). `rope_latent_store` is one: a program per token
normalises and ropes the latent, writes it to its (block, layer, offset) slot of the pool (FP8
pools: times the reciprocal of the pool's scale and saturated, as `engine.kv_pool.write_rows`),
and ropes the token's H query rows (a program per 16 heads).

With the queries' non-rope part and each head's W_UK (kv_b_proj's key rows), the same launch
also computes the absorbed query q_lat = q_nope · W_UK [T, H, R] that MLA decode attention reads
(programs after the rope's, each 16 to 64 tokens × one head × 128 latent columns through tl.dot,
float32 sums rounded once, as the batched GEMM it replaces): at batch 1 on an H100 that GEMM was a launch
of its own, 3.7 µs a layer (docs/bench/profile_decode_M_run22_h100.jsonl).

The kernel rounds where the plain functions round (the normalised row to the model dtype before
the weight; each rope product, then their sum), so in bf16 its ropes are the bits of
`rope_latent_store_reference`, and its normalised latent differs only through the RMS's
summation order and rsqrt: a float32 ulp there can move a value by up to two bf16 rounding steps
once the weight multiplies it (tests allow two and count the identical share). The reference is `engine.model.rope_latent`
(the plain function, not the compiled one) plus `engine.kv_pool.write_rows`; the decode step on
a CPU (tests) runs it.
"""

from __future__ import annotations

import torch

from engine.kernels import pdl
from engine.kv_pool import FP8, FP8_MAX, reciprocal32, write_rows

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


def rope_latent_store_reference(q_pe: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                norm_weight: torch.Tensor, eps: float, rank: int, interleave: bool,
                                kv: torch.Tensor, layer: int, w_blk: torch.Tensor, w_off: torch.Tensor,
                                kv_scale: float = 1.0, q_nope: torch.Tensor | None = None,
                                w_uk: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What `rope_latent_store` computes, in plain torch.

    Args:
        q_pe: [T, H, P] the queries' rope part, before rope (may be a strided view).
        kv_a: [T, R + P] kv_a_proj_with_mqa's output (c_kv, then k_pe; rows may be strided).
        cos, sin: [T, P] (engine.model.rope_cos_sin, the model dtype).
        norm_weight: [R] kv_a_layernorm's weight; eps its epsilon; rank R (kv_lora_rank).
        interleave: the checkpoint's rope_interleave (engine.model.apply_rope).
        kv: [blocks, layers, block_size, R + P] the pool (model dtype, or float8_e4m3fn holding
            latent / kv_scale); layer: the pool layer written.
        w_blk, w_off: [T] int64 the block and the offset in it of each token's row.
        kv_scale: FP8 pools' scale (ignored for other dtypes).
        q_nope, w_uk: with both, also the absorbed query: q_nope [T, H, N] (the queries' non-rope
            part, may be a strided view) times each head's W_UK w_uk [H, N, R] (kv_b_proj's key
            rows of the head, a view of its weight).
    Returns:
        q_pe roped, [T, H, P] contiguous, q_pe's dtype; with q_nope and w_uk, (that, q_lat [T, H,
        R] contiguous, q_nope's dtype). Writes row (w_blk[t], layer, w_off[t]).
    """
    from engine.model import rope_latent
    q, latent = rope_latent(q_pe, kv_a, cos, sin, norm_weight, eps, rank, interleave)
    write_rows(kv, w_blk, layer, w_off, latent, kv.dtype == FP8, kv_scale)
    if q_nope is None or w_uk is None:
        return q.contiguous()
    return q.contiguous(), torch.einsum("bhn,hnr->bhr", q_nope, w_uk)


# The absorbed query's programs: BLOCK_T tokens (tl.dot's least, 16, up to ABSORB_MAX_BLOCK_T as
# the step grows: each token block reads every head's W_UK once more, from L2 but still bytes) ×
# BLOCK_L latent columns of one head. A decode step at batch 1 pads its token to 16 rows (the bytes
# are W_UK's, 128 KB a head); config M's 16 heads × 512 columns are 64 programs beside the rope's
ABSORB_BLOCK_L = 128
ABSORB_MAX_BLOCK_T = 64


def absorb_block_t(tokens: int) -> int:
    """BLOCK_T of the absorbed query's programs for a step of `tokens` tokens: 16, 32 or 64."""
    return min(ABSORB_MAX_BLOCK_T, max(16, triton.next_power_of_2(tokens)))


if triton is not None:
    from engine.kernels.pdl import wait_then_release

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        # a value rounded to the model dtype, back in float32 (where the plain function rounds)
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rope(ptr, offs_p, P: tl.constexpr, pmask, cos, sin, INTERLEAVE: tl.constexpr, dtype: tl.constexpr):
        # engine.model.apply_rope on the rows at ptr [..., P] (ptr broadcast against offs_p):
        # x' = x's dims as [even..., odd...] when interleaved; out = x'·cos + rotate_half(x')·sin
        half: tl.constexpr = P // 2
        lo = offs_p < half
        if INTERLEAVE:
            src = tl.where(lo, 2 * offs_p, 2 * (offs_p - half) + 1)
            mate = src ^ 1  # x' at j ± half is the other element of j's pair
        else:
            src = offs_p
            mate = tl.where(lo, offs_p + half, offs_p - half)
        x = tl.load(ptr + src, mask=pmask, other=0.0).to(tl.float32)
        xm = tl.load(ptr + mate, mask=pmask, other=0.0).to(tl.float32)
        xm = tl.where(lo, -xm, xm)  # rotate_half: (-x2, x1)
        # in float32, rounded once: what the compiled rope_latent computes on a GPU (inductor keeps
        # a bf16 expression's intermediates in float32; the H100 run showed the eager rounding of
        # each product, which the plain functions do, one bf16 step off on some elements)
        return _round(x * cos + xm * sin, dtype)

    @triton.jit
    def _absorb(j, T, QN, WUK, OutL, stride_nt, stride_nh, stride_wh, stride_wn, stride_lt, stride_lh,
                H: tl.constexpr, R: tl.constexpr, NOPE: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, IEEE: tl.constexpr):
        # absorb program j: tokens tb·BLOCK_T.., head h, latent columns rb·BLOCK_L..:
        # q_lat = q_nope [BLOCK_T, NOPE] @ W_UK[h] [NOPE, BLOCK_L], float32 sums, rounded once
        # the token block varies fastest: programs reading one W_UK tile run side by side (its
        # bytes from HBM once, then L2), as the batched GEMM read each head's W_UK once
        n_rb: tl.constexpr = (R + BLOCK_L - 1) // BLOCK_L
        n_tb = (T + BLOCK_T - 1) // BLOCK_T
        tb = j % n_tb
        rb = (j // n_tb) % n_rb
        h = j // (n_tb * n_rb)
        offs_t = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = tl.arange(0, BLOCK_N)
        offs_r = rb * BLOCK_L + tl.arange(0, BLOCK_L)
        tmask, nmask, rmask = offs_t < T, offs_n < NOPE, offs_r < R
        a = tl.load(QN + offs_t[:, None] * stride_nt + h * stride_nh + offs_n[None, :],
                    mask=tmask[:, None] & nmask[None, :], other=0.0)
        w = tl.load(WUK + h * stride_wh + offs_n[:, None] * stride_wn + offs_r[None, :],
                    mask=nmask[:, None] & rmask[None, :], other=0.0)
        if IEEE:  # float32 inputs: full-precision products (tf32 would round them)
            acc = tl.dot(a, w, input_precision="ieee")
        else:
            acc = tl.dot(a, w)
        tl.store(OutL + offs_t[:, None] * stride_lt + h * stride_lh + offs_r[None, :],
                 acc.to(OutL.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])

    @triton.jit
    def _rope_latent_store(QPE, KVA, Cos, Sin, NormW, KV, Blk, Off, OutQ, QN, WUK, OutL,
                           layer, eps, inv_scale, fmax, T, N_HB,
                           stride_qt, stride_qh, stride_at, stride_ct, stride_st,
                           stride_kblk, stride_klayer, stride_ktok, stride_ot, stride_oh,
                           stride_nt, stride_nh, stride_wh, stride_wn, stride_lt, stride_lh,
                           H: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                           INTERLEAVE: tl.constexpr, IS_FP8: tl.constexpr,
                           NOPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_L: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        # programs 0 .. T·N_HB - 1: (t, hb), token t's query heads hb·BLOCK_H.. (BLOCK_H ≤ 16 keeps
        # a program's tiles in registers at DeepSeek-V3's 128 heads); the programs hb = 0 also
        # write the latent. Programs after them (with q_nope given): the absorbed query, `_absorb`
        pid = tl.program_id(0)
        if pid >= T * N_HB:
            _absorb(pid - T * N_HB, T, QN, WUK, OutL, stride_nt, stride_nh, stride_wh, stride_wn, stride_lt,
                    stride_lh, H, R, NOPE, BLOCK_T, BLOCK_N, BLOCK_L, IEEE)
            return
        t = (pid // N_HB).to(tl.int64)
        hb = pid % N_HB
        dtype: tl.constexpr = OutQ.dtype.element_ty
        offs_p = tl.arange(0, BLOCK_P)
        pmask = offs_p < P
        row = KVA + t * stride_at
        cos = tl.load(Cos + t * stride_ct + offs_p, mask=pmask, other=0.0).to(tl.float32)
        sin = tl.load(Sin + t * stride_st + offs_p, mask=pmask, other=0.0).to(tl.float32)
        if hb == 0:
            offs_r = tl.arange(0, BLOCK_R)
            rmask = offs_r < R
            # RMSNorm(c_kv) as engine.model.rms_norm: float32, rounded back, then times the weight
            c = tl.load(row + offs_r, mask=rmask, other=0.0).to(tl.float32)
            c = _round(c * tl.math.rsqrt(tl.sum(c * c, 0) / R + eps), dtype)
            w = tl.load(NormW + offs_r, mask=rmask, other=0.0).to(tl.float32)
            c = _round(w * c, dtype)
            k = _rope(row + R, offs_p, P, pmask, cos, sin, INTERLEAVE, dtype)
            dst = KV + tl.load(Blk + t) * stride_kblk + layer * stride_klayer + tl.load(Off + t) * stride_ktok
            if IS_FP8:  # latent × 1/scale, saturated to e4m3's range (a cast beyond it is NaN); NaN stays NaN
                c = tl.minimum(tl.maximum(c * inv_scale, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax,
                               propagate_nan=tl.PropagateNan.ALL)
                k = tl.minimum(tl.maximum(k * inv_scale, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax,
                               propagate_nan=tl.PropagateNan.ALL)
            tl.store(dst + offs_r, c.to(KV.dtype.element_ty), mask=rmask)
            tl.store(dst + R + offs_p, k.to(KV.dtype.element_ty), mask=pmask)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        qrow = QPE + t * stride_qt + offs_h[:, None] * stride_qh
        q = _rope(qrow, offs_p[None, :], P, hmask[:, None] & pmask[None, :], cos[None, :], sin[None, :],
                  INTERLEAVE, dtype)
        tl.store(OutQ + t * stride_ot + offs_h[:, None] * stride_oh + offs_p[None, :], q.to(dtype),
                 mask=hmask[:, None] & pmask[None, :])


def rope_latent_store(q_pe: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, rank: int, interleave: bool,
                      kv: torch.Tensor, layer: int, w_blk: torch.Tensor, w_off: torch.Tensor,
                      kv_scale: float = 1.0, q_nope: torch.Tensor | None = None,
                      w_uk: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rope_latent_store_reference` as one Triton kernel (a program per token and 16 query
    heads; with q_nope and w_uk, after them a program per 16 to 64 tokens, head and 128 latent
    columns for the absorbed query, with tl.dot: the W_UK product that was a launch of its own); the
    same arguments and result. Inputs whose last dimension is strided are copied first (the
    decode step's views of the fused projection's output need no copy). FP8 pools: the row
    times `engine.kv_pool.reciprocal32(kv_scale)`, the multiplier of every FP8 write.

    Raises RuntimeError when triton is not installed, ValueError on a shape mismatch.
    """
    if triton is None:
        raise RuntimeError("rope_latent_store needs triton (pip install triton; it ships with CUDA torch)")
    t, h, p = q_pe.shape
    if (kv_a.shape != (t, rank + p) or kv.shape[-1] != rank + p or cos.shape != (t, p) or sin.shape != (t, p)
            or norm_weight.shape != (rank,) or w_blk.shape != (t,) or w_off.shape != (t,) or p % 2):
        raise ValueError(f"q_pe {tuple(q_pe.shape)}, kv_a {tuple(kv_a.shape)}, cos/sin {tuple(cos.shape)}/"
                         f"{tuple(sin.shape)}, weight {tuple(norm_weight.shape)}, slots {tuple(w_blk.shape)}/"
                         f"{tuple(w_off.shape)}, pool rows {kv.shape[-1]}, kv_lora_rank {rank}: need kv_a [T, R + P], "
                         "cos and sin [T, P], weight [R], slots [T], pool rows R + P and an even P")
    if kv.stride(-1) != 1:
        raise ValueError("rope_latent_store writes the pool in place: its rows must be contiguous")
    if (q_nope is None) != (w_uk is None):
        raise ValueError("rope_latent_store: q_nope and w_uk go together (the absorbed query needs both)")
    absorb = q_nope is not None
    if absorb:
        nope = q_nope.shape[-1]
        if q_nope.shape[:2] != (t, h) or w_uk.shape != (h, nope, rank) or w_uk.stride(-1) != 1:
            raise ValueError(f"q_nope {tuple(q_nope.shape)} and w_uk {tuple(w_uk.shape)} (last stride "
                             f"{w_uk.stride(-1)}): need q_nope [T, H, N] and w_uk [H, N, R] with unit stride along R")
        q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe, kv_a, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_pe, kv_a, cos, sin))
    w_blk, w_off = w_blk.long(), w_off.long()  # a no-op for the decode step's int64 slots
    out = torch.empty((t, h, p), dtype=q_pe.dtype, device=q_pe.device)
    q_lat = torch.empty((t, h, rank), dtype=q_nope.dtype, device=q_pe.device) if absorb else out
    if t == 0:
        return (out, q_lat) if absorb else out
    is_fp8 = kv.dtype == FP8
    block_h = min(16, triton.next_power_of_2(h))
    n_hb = triton.cdiv(h, block_h)
    block_t, block_l = (absorb_block_t(t) if absorb else 16), ABSORB_BLOCK_L  # (one variant without absorb)
    n_absorb = triton.cdiv(t, block_t) * h * triton.cdiv(rank, block_l) if absorb else 0
    qn, wuk = (q_nope, w_uk) if absorb else (out, out)  # unread without absorb (programs past T · N_HB only)
    _rope_latent_store[(t * n_hb + n_absorb,)](
        q_pe, kv_a, cos, sin, norm_weight, kv, w_blk, w_off, out, qn, wuk, q_lat,
        layer, eps, reciprocal32(kv_scale) if is_fp8 else 1.0, FP8_MAX, t, n_hb,
        q_pe.stride(0), q_pe.stride(1), kv_a.stride(0), cos.stride(0), sin.stride(0),
        kv.stride(0), kv.stride(1), kv.stride(2), out.stride(0), out.stride(1),
        qn.stride(0), qn.stride(1), wuk.stride(0), wuk.stride(1), q_lat.stride(0), q_lat.stride(1),
        H=h, R=rank, P=p, BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(p), INTERLEAVE=interleave, IS_FP8=is_fp8,
        NOPE=q_nope.shape[-1] if absorb else 1, BLOCK_T=block_t,
        BLOCK_N=max(16, triton.next_power_of_2(q_nope.shape[-1])) if absorb else 16, BLOCK_L=block_l,
        IEEE=absorb and q_nope.dtype == torch.float32, num_warps=4, **pdl.flags())
    return (out, q_lat) if absorb else out
