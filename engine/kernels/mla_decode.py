"""Paged MLA decode attention over the compressed latent pool.

With W_UK absorbed into the query and W_UV into the output (DeepSeek-V2 report section
2.1.2), decode attention of one new token per sequence is, per sequence b and head h:

    s_t   = (q[b, h, :R] · c_kv[t] + q[b, h, R:] · k_pe[t]) × sm_scale     for t < lens[b]
    o_lat = softmax(s) · c_kv                                              -> [R]

over the cached latent rows [c_kv (R = kv_lora_rank); k_pe (P = qk_rope_head_dim)] of the
sequence's blocks. All heads share one latent row (MQA-like), so the kernel loads each KV tile
once per head group and computes every head of the group from it. Long contexts are split
across thread blocks (flash-decoding / split-K): stage 1 computes each split's partial output
and log-sum-exp, stage 2 merges the splits. The model of the two stages is SGLang's Triton
decode attention (`decode_attention_fwd`: `_fwd_grouped_kernel_stage1` / `_fwd_kernel_stage2`);
FlashMLA and FlashInfer's MLA decode do the same on the latent with hand-written kernels.

The work of a sequence depends on its own length, not on the block-table width, so one CUDA
graph per batch size serves every context length up to the table width.

`mla_decode_reference` is the plain-torch definition (tests compare the two); the worker runs
`mla_decode` (Triton) on CUDA.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.kernels import pdl

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

FP8 = torch.float8_e4m3fn
MAX_SPLITS = 32  # context splits per sequence, at most (stage 2 merges up to this many)


def mla_decode_reference(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                         lens: torch.Tensor, kv_lora_rank: int, sm_scale: float,
                         kv_scale: float = 1.0, q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch paged MLA decode attention (what `mla_decode` computes), in float32.

    Args:
        q: [B, H, R + P] absorbed queries: (q_nope W_UK) then the roped q_pe; or [B, H, R]
            when q_pe [B, H, P] comes apart (the same as their concatenation).
        kv: [num_blocks, num_layers, block_size, R + P] the pool (model dtype, or float8_e4m3fn
            holding latent / kv_scale).
        layer: the pool layer to read.
        tables: [B, W] block tables; entries past a sequence's blocks may be any valid block
            id (their rows are masked by lens).
        lens: [B] context lengths, 1 <= lens[b] <= W × block_size.
        kv_lora_rank: R.
        sm_scale: multiplier of q·k.
        kv_scale: FP8 pools' dequantisation scale (ignored for other dtypes).
    Returns:
        o_lat [B, H, R] float32: softmax-weighted sums of the c_kv rows.
    """
    if q_pe is not None:
        q = torch.cat((q, q_pe), dim=-1)
    b = q.shape[0]
    ctx = kv[tables.long(), layer].reshape(b, -1, kv.shape[-1]).float()  # [B, S, R + P]
    if kv.dtype == FP8:
        ctx = ctx * kv_scale
    scores = torch.einsum("bhd,bsd->bhs", q.float(), ctx) * sm_scale  # [B, H, S]
    span = torch.arange(ctx.shape[1], device=q.device)
    scores = scores.masked_fill((span[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsr->bhr", scores.softmax(-1), ctx[..., :kv_lora_rank])


def num_splits(batch: int, head_groups: int, sms: int = 132, waves: int = 2) -> int:
    """Context splits per sequence so that batch × head_groups × splits fills ~`waves` waves of SMs."""
    want = -(-waves * sms // max(1, batch * head_groups))
    return max(1, min(MAX_SPLITS, want))


@dataclasses.dataclass(frozen=True)
class Stage1Config:
    """Launch shape of stage 1: KV rows per loop iteration (block_n), warps per program, the
    software-pipelining depth (num_stages) and the waves of SMs the context splits aim at
    (`num_splits`). tools/bench_mla_decode.py sweeps these on a GPU.

    The default stays the served path's best measured: on one H200 (2026-12-04) the kernel alone
    was fastest at (64, 8, 3 stages, 4 waves, one split once the batch covers the SMs) — batch
    64 × 8K context 307 -> 215 µs, batch 256 × 1K 133 -> 112 µs, batch 64 × 1K 52.6 -> 50.0 µs —
    but served through `tandem up` (config S, 1K context, concurrency 64, the prefill worker's
    process on the same GPU) the decode step took 2.74 ms of device time against 2.49 ms with
    this default in the same call (TPOT 3.53 against 2.88 ms). Its ~221 KB of shared memory per
    program is the likely cost when the GPU switches between the two processes' contexts."""
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 2


DEFAULT_STAGE1 = Stage1Config()


if triton is not None:
    from engine.kernels.pdl import wait_then_release

    @triton.jit
    def _mla_stage1(Q, QPE, KV, Tables, Lens, PartO, PartLse,
                    layer, sm_scale, kv_scale,
                    stride_qb, stride_qh, stride_pb, stride_ph, stride_kblk, stride_klayer, stride_ktok,
                    stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    SPLITS, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                    IS_FP8: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        b = tl.program_id(0)
        hg = tl.program_id(1)
        split = tl.program_id(2)
        heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        offs_r = tl.arange(0, R)
        offs_p = tl.arange(0, BLOCK_P)
        pmask = offs_p < P
        qrow = Q + b * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(qrow + offs_r[None, :], mask=hmask[:, None], other=0.0)  # [BH, R]
        q_pe = tl.load(QPE + b * stride_pb + heads[:, None] * stride_ph + offs_p[None, :],
                       mask=hmask[:, None] & pmask[None, :], other=0.0)

        seq_len = tl.load(Lens + b).to(tl.int32)
        per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, R], tl.float32)
        qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
        if IS_FP8:
            qk_scale = qk_scale * kv_scale
        kv_layer = KV + layer * stride_klayer
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            blk = tl.load(Tables + b * stride_tb + offs_n // BLOCK_SIZE, mask=nmask, other=0)
            row = kv_layer + blk.to(tl.int64) * stride_kblk + (offs_n % BLOCK_SIZE) * stride_ktok
            c_kv = tl.load(row[:, None] + offs_r[None, :], mask=nmask[:, None], other=0.0)  # [N, R]
            k_pe = tl.load(row[:, None] + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :],
                           other=0.0)  # [N, P]
            if IS_FP8:
                c_kv = c_kv.to(q_lat.dtype)
                k_pe = k_pe.to(q_lat.dtype)
            s = tl.dot(q_lat, tl.trans(c_kv)) + tl.dot(q_pe, tl.trans(k_pe))  # [BH, N] fp32
            s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv)
            m_i = m_new
        out_base = PartO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
        lse_ptr = PartLse + b * stride_lb + heads * stride_lh + split
        if end > start:
            o = acc / l_i[:, None]
            if IS_FP8:
                o = o * kv_scale
            tl.store(out_base + offs_r[None, :], o, mask=hmask[:, None])
            tl.store(lse_ptr, m_i + tl.log2(l_i), mask=hmask)  # log2-sum-exp2
        else:
            tl.store(lse_ptr, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hmask)

    @triton.jit
    def _mla_stage2(PartO, PartLse, Out, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                    stride_outb, stride_outh, SPLITS, R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        smask = offs_s < SPLITS
        lse = tl.load(PartLse + b * stride_lb + h * stride_lh + offs_s, mask=smask,
                      other=float("-inf"))  # [S]
        m = tl.max(lse, 0)
        w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
        offs_r = tl.arange(0, R)
        o = tl.load(PartO + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_r[None, :],
                    mask=smask[:, None] & (lse > float("-inf"))[:, None], other=0.0)  # [S, R]
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(Out + b * stride_outb + h * stride_outh + offs_r, out.to(Out.dtype.element_ty))


def mla_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
               lens: torch.Tensor, kv_lora_rank: int, sm_scale: float, kv_scale: float = 1.0,
               splits: int | None = None, config: Stage1Config | None = None,
               q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """Triton paged MLA decode attention; the same contract as `mla_decode_reference`, but
    returns o_lat [B, H, R] in q's dtype (bf16/fp16; the pool bf16/fp16 or float8_e4m3fn).
    R (kv_lora_rank) must be a power of two >= 16 (512 in DeepSeek-V2/V3). q and q_pe may be
    strided (each row's last dimension contiguous): the decode step passes the absorbed query
    and the roped q_pe as they come, with no concatenation.

    Args (beyond the reference's): splits: context splits per sequence (default
    `num_splits(B, head groups, SMs, config.waves)`); config: stage 1's launch shape (default
    `DEFAULT_STAGE1`). Scratch buffers are allocated per call (inside a CUDA
    graph they come from the graph's pool).
    Raises RuntimeError when triton is not installed.
    """
    if triton is None:
        raise RuntimeError("mla_decode needs triton (pip install triton; it ships with CUDA torch)")
    r = kv_lora_rank
    if q_pe is None:
        q, q_pe = q[..., :r], q[..., r:]
    q = q if q.stride(-1) == 1 else q.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    b, h, _ = q.shape
    p = q_pe.shape[-1]
    d = r + p
    if q.shape[-1] != r or d != kv.shape[-1] or r < 16 or r & (r - 1):
        raise ValueError(f"q width {d}, kv width {kv.shape[-1]}, kv_lora_rank {r}: need equal widths "
                         "and a power-of-two kv_lora_rank >= 16")
    block_h = 16 if h <= 16 else 32
    head_groups = -(-h // block_h)
    cfg = config or DEFAULT_STAGE1
    s = min(splits or num_splits(b, head_groups, _sms(q.device), cfg.waves), MAX_SPLITS)
    part_o = torch.empty(b, h, s, r, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    out = torch.empty(b, h, r, dtype=q.dtype, device=q.device)
    is_fp8 = kv.dtype == FP8
    _mla_stage1[(b, head_groups, s)](
        q, q_pe, kv, tables, lens, part_o, part_lse, layer, sm_scale, kv_scale,
        q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        tables.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        H=h, R=r, P=p, BLOCK_SIZE=kv.shape[2], SPLITS=s, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        BLOCK_P=max(16, triton.next_power_of_2(p)), IS_FP8=is_fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.flags())
    _mla_stage2[(b, h)](
        part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        # BLOCK_S: num_splits' cap (one compile for any split count)
        SPLITS=s, R=r, BLOCK_S=32, num_warps=4, **pdl.flags())
    return out


_SM_COUNT: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
