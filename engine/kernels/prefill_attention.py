"""Causal attention of a prefill chunk over its cached prefix plus itself, on the GPU.

A chunk's T queries are the last T of its S context rows (the KvCache contract), so its mask is
the lower-right causal one. On an H200 with MLA's head sizes (q/k 192, v 128; tools/profile_prefill.py,
docs/benchmarks.md "Where a prefill's GPU time goes"):

| SDPA, 16 heads                          | flash (v padded to 192) | cuDNN, v 128 |
|-----------------------------------------|------------------------:|-------------:|
| T = S = 32,768, causal                  | 271 TFLOP/s             | 632 TFLOP/s  |
| T = 8,192 over S = 32,768, lower-right  | 260 TFLOP/s             | 292 (dense mask) |

cuDNN's fused kernel takes top-left causal masks only (a lower-right one reaches it as a dense
boolean mask, read for every tile), and PyTorch sends `causal_lower_right` to FlashAttention-2.
So `prefix_causal_attention` splits the chunk's attention in two: its queries over the S − T
prefix rows (no mask: every prefix row is before every query) and over its own T rows (square,
so top-left causal = lower-right), both through cuDNN with their log-sum-exps, and merges them:

    out = (e^(l1 − m) · o1 + e^(l2 − m) · o2) / (e^(l1 − m) + e^(l2 − m)),  m = max(l1, l2)

(the softmax over the union of the two key sets; each part's o is softmax-weighted within it,
l its natural-log sum of exp(scale · q·k)). The merge runs in float32; the result is x's dtype.

cuDNN builds an execution graph for each new shape (50–65 ms on the H200), so only chunks of
at least CUDNN_MIN_QUERIES queries use it, with their queries padded to a few buckets and the
prefix cut into multiples of PREFIX_KEY_UNIT (the remainder, and every shorter chunk, through
FlashAttention, which builds nothing).

Backends: `torch.ops.aten._scaled_dot_product_cudnn_attention` (returns the log-sum-exp) with v
at its own head size; where it refuses (an older cuDNN, a GPU it does not support), the same
split through `_scaled_dot_product_flash_attention` with v padded to the qk size (one head size
for all three is FlashAttention's rule). The first refusal is logged and the flash form used for
the rest of the process.

Reference: the masked `F.scaled_dot_product_attention` of `engine.model.mla_attention` (the
CPU path); tests/test_prefill_attention.py compares the two on CUDA.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_CUDNN_OK: bool | None = None  # None until the first call tried cuDNN


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0][..., :dv], out[1]


CUDNN_MIN_QUERIES = 2048
"""Parts with fewer queries go to FlashAttention: cuDNN builds an execution graph for every new
shape (about 50–65 ms on an H200, measured), which a short chunk's attention (well under 1 ms)
would never earn back; served prompts come in every length."""
QUERY_BUCKET = 1024  # cuDNN parts pad their queries to a power of two times this (few shapes)
PREFIX_KEY_UNIT = 4096  # cuDNN takes the prefix in multiples of this; the rest of it goes to flash
PACK_MAX_ROWS = 32768
"""Context rows one varlen call of a prefill batch covers at most (engine/model.py
`MLAttention._packed_attention`): its keys and values, up-projected for every head, take
H × 1,280 bytes per row (1.3 GB at 16 heads), and chunks sharing a cached prefix each gather
it again; more rows go to further calls."""


def _bucket(t: int) -> int:
    b = QUERY_BUCKET
    while b < t:
        b *= 2
    return b


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, cudnn: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp.

    Args:
        q: [B, H, T, D]; k: [B, H, S, D]; v: [B, H, S, Dv] (Dv <= D), CUDA, bf16 / fp16.
        causal: top-left causal mask (query i sees keys 0..i; use with T == S).
        scale: multiplier of q·k.
        cudnn: try cuDNN first (False: FlashAttention only).
    Returns:
        (out [B, H, T, Dv] in q's dtype, lse [B, H, T] float32: natural log of each query's sum
        of exp(scale · q·k) over the keys it sees).
    """
    global _CUDNN_OK
    if cudnn and _CUDNN_OK is not False:
        try:
            out, lse = _cudnn(q, k, v, causal, scale)
            _CUDNN_OK = True
            return out, lse.reshape(q.shape[:3]).float()
        except RuntimeError as exc:
            if _CUDNN_OK:  # it worked before: this is a real failure (e.g. out of memory)
                raise
            _CUDNN_OK = False
            log.warning("cuDNN attention refused MLA's shapes (%s); prefill attention uses FlashAttention "
                        "with v padded to the qk head size", str(exc).splitlines()[0][:200])
    out, lse = _flash(q, k, v, causal, scale)
    return out, lse.reshape(q.shape[:3]).float()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[2] == rows else F.pad(x, (0, 0, 0, rows - x.shape[2]))


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor,
          l2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted union of two attentions over disjoint key sets.

    Args: o1, o2 [B, H, T, Dv]; l1, l2 [B, H, T] float32 log-sum-exps.
    Returns: (out [B, H, T, Dv] in o1's dtype, the sums in float32; its lse [B, H, T] float32).
    """
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    den = w1 + w2
    out = o1.float() * (w1 / den)[..., None] + o2.float() * (w2 / den)[..., None]
    return out.to(o1.dtype), m + torch.log(den)


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right causal attention of T queries over S >= T keys (the queries are the keys'
    last T positions): query i sees keys 0 .. S − T + i.

    Parts (each with its log-sum-exp, merged by `merge`): the chunk's own T rows (square, top-left
    causal) and the S − T prefix rows (no mask). With T >= CUDNN_MIN_QUERIES the queries are
    padded at the end to a bucket (`_bucket`: padded rows are dropped; in the square part the
    padded keys come after every real query, so causality hides them) and the prefix is taken by
    cuDNN in multiples of PREFIX_KEY_UNIT rows, its remainder by FlashAttention: a long prompt's
    chunks then reuse a few cuDNN graphs instead of building one per shape. Shorter chunks go
    to FlashAttention whole.

    Args:
        q: [B, H, T, D]; k: [B, H, S, D]; v: [B, H, S, Dv] (Dv <= D), CUDA, bf16 / fp16.
        scale: multiplier of q·k.
    Returns:
        [B, H, T, Dv] in q's dtype.
    Raises:
        ValueError: S < T.
    """
    t, s = q.shape[2], k.shape[2]
    if s < t:
        raise ValueError(f"prefix_causal_attention: {t} queries need at least {t} keys, got {s}")
    p = s - t
    big = t >= CUDNN_MIN_QUERIES
    tb = _bucket(t) if big else t
    qb = _pad_rows(q, tb)
    o, lse = attention_lse(qb, _pad_rows(k[:, :, p:], tb), _pad_rows(v[:, :, p:], tb), True, scale, big)
    cut = p // PREFIX_KEY_UNIT * PREFIX_KEY_UNIT if big else 0
    for lo, hi, use_cudnn in ((0, cut, True), (cut, p, False)):
        if hi > lo:  # the prefix rows [lo, hi): no mask
            o2, l2 = attention_lse(qb, k[:, :, lo:hi], v[:, :, lo:hi], False, scale, use_cudnn)
            o, lse = merge(o, lse, o2, l2)
    return o[:, :, :t]


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                            cu_k: torch.Tensor, used_k: torch.Tensor, max_q: int, max_k: int,
                            scale: float) -> torch.Tensor:
    """Lower-right causal attention of several sequences in one FlashAttention-2 varlen call.

    Sequence i's queries are rows cu_q[i] .. cu_q[i+1] of q and its keys rows cu_k[i] ..
    cu_k[i] + used_k[i] of k and v (rows after them, up to cu_k[i+1], are ignored: a context
    gathered as whole pool blocks ends with a partial block's padding); its queries are its keys'
    last positions, so query j of T sees keys 0 .. used_k[i] − T + j (FlashAttention-2 aligns a
    causal mask to the bottom right). One call replaces a prefill batch's per-sequence attention
    launches: a batch of short chunks (engine/model.py `packed_mla_attention`) was bound by the
    host's launches, not by the kernel.

    Args:
        q: [Tq, H, D]; k: [R, H, D]; v: [R, H, Dv] (Dv <= D), CUDA, bf16 / fp16.
        cu_q, cu_k: [n + 1] int32 row offsets on q's device; used_k: [n] int32 key rows used.
        max_q, max_k: the longest sequence's queries and used keys.
        scale: multiplier of q·k.
    Returns:
        [Tq, H, Dv] in q's dtype.
    Reference: `engine.model.mla_attention` per sequence (tests/test_prefill_attention.py).
    """
    dv = v.shape[-1]
    if dv < q.shape[-1]:  # one head size for q, k and v (FlashAttention's rule)
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                  scale=scale, seqused_k=used_k)[0]
    return out[..., :dv]


def varlen_causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                                      cu_k: torch.Tensor, used_k: torch.Tensor, max_q: int, max_k: int,
                                      scale: float) -> torch.Tensor:
    """`varlen_causal_attention`'s definition, sequence by sequence with a boolean lower-right
    causal mask (any device and dtype; the tests' twin of the kernel)."""
    out = []
    for i in range(cu_q.shape[0] - 1):
        q0, q1, k0, used = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(used_k[i])
        t = q1 - q0
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[q0:q1], k[k0:k0 + used], v[k0:k0 + used]))
        mask = torch.arange(used, device=q.device)[None, :] <= torch.arange(used - t, used, device=q.device)[:, None]
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)[0].transpose(0, 1))
    return torch.cat(out)
