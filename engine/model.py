"""A DeepSeek-V3-architecture transformer in plain torch, with Hugging Face weight names.

Sources: Hugging Face `transformers/models/deepseek_v3/modeling_deepseek_v3.py` (RMSNorm, RoPE
with `rope_interleave`, MLA attention, sigmoid group-limited routing, MoE, decoder layer); the
DeepSeek-V3 technical report (arXiv:2412.19437) sections 2.1 (MLA), 2.1.2 (DeepSeekMoE,
auxiliary-loss-free bias) and 2.2 (MTP); the MTP weight layout of the DeepSeek-V3 checkpoint
(`model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head.*,embed_tokens}`), as read by vLLM's and
SGLang's DeepSeek MTP models.

The forward pass takes a flat batch: the new tokens of several sequences concatenated
(`T = sum(q_lens)` rows). Linear layers run on the whole batch; attention runs per sequence on
that sequence's cached MLA latents, which the caller's `KvCache` stores and returns. The cached
value per token and layer is the *latent* `cat(kv_a_layernorm(c_kv), rope(k_pe))`, `kv_dim`
wide; attention expands it through `kv_b_proj` (no weight absorption yet).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig

# HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class KvCache(Protocol):
    """Where the model stores and reads the MLA latents of a batch, one call per layer."""

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        """Store latent [T, kv_dim] for the batch's new tokens of `layer` (T = sum(q_lens),
        sequences concatenated in order) and return, per sequence i, its whole context latent
        [S_i, kv_dim] (past tokens then this step's new tokens; row r has position r), in the
        model's dtype. Layers are numbered 0..num_hidden_layers-1, MTP module k uses
        num_hidden_layers + k."""
        ...


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)  # no biases in DeepSeek-V3


def _embedding(vocab: int, hidden: int) -> nn.Embedding:
    # an explicit weight skips nn.Embedding's own init (on meta it costs a slow first import)
    return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF: x [..., dim] normalised in float32, cast back, then scaled by weight [dim]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up (elementwise)."""
    return F.silu(gate) * up


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm of its result: (s, rms_norm(s)) with s = x + delta, or
    x + (delta + delta2) (a MoE layer's routed and shared experts, summed first as MoE.forward
    does), all [T, hidden]. The same additions in the same order as the unfused layer, so the
    plain function is bit-identical to it; compiled (engine/kernels/fused.py) it is one kernel
    where the unfused form launches two or three."""
    s = x + sum_parts(x.dtype, delta, delta2)
    return s, rms_norm(s, weight, eps)


def slot_sum(delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A MoE output still per slot, [T, slots, hidden] float32 (engine/kernels/fused_moe.py with
    sum_slots=False), summed over its slots and cast to dtype: [T, hidden], the plain function
    bit for bit what fused_experts' own sum returns. A [T, hidden] delta passes through. Inside
    the compiled add + RMSNorm (GPU) the sum and cast are part of that one kernel instead of two
    launches of their own; there inductor adds the float32 sum to x before rounding (its default:
    casts inside a kernel are not rounded), so the residual can differ from the eager form in
    its last bit."""
    return delta.sum(1).to(dtype) if delta.dim() == 3 else delta


def sum_parts(dtype: torch.dtype, routed: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """A MLP's output from its parts (MoE.forward_parts, or a dense MLP's one output): routed
    (per slot or not, `slot_sum`) plus shared (per slot too: one sum over both's slots), in that
    order, as the unfused layer summed them;
    [T, hidden] in dtype. MoE.forward, add_pending and add_rms_norm all sum through here."""
    if shared is not None and shared.dim() == 3:  # both per slot (a one-token MoE layer in two
        # branches, GroupedExperts.forward_branched): one sum over all their slots in order, the
        # one-branch form's [T, routed + shared slots, hidden] tensor summed
        return slot_sum(torch.cat((routed, shared), 1), dtype)
    routed = slot_sum(routed, dtype)
    return routed if shared is None else routed + shared


class HotPath:
    """The model's elementwise hot spots, called through this table so that a GPU runner can
    swap in fused (torch.compile'd) versions of the same functions (engine/kernels/fused.py);
    on a CPU they stay these plain functions, the reference."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rms_norm, self.silu_mul, self.add_rms_norm = rms_norm, silu_mul, add_rms_norm
        self.rope_cos_sin, self.apply_rope, self.route = rope_cos_sin, apply_rope, route
        self.rope_latent = rope_latent
        self.fused = False


_BRANCHING = threading.local()  # per thread: see shared_experts_beside


@contextlib.contextmanager
def shared_experts_beside():
    """Within this, on this thread, a one-token MoE layer runs its shared experts on a second
    stream (engine.kernels.grouped_experts.GroupedExperts.forward_branched; MoE.forward_parts asks
    `branching`).
    The decode and MTP graphs' warm-up and capture run in it (engine/graph_runner.py,
    engine/spec_graphs.py): there the two streams become two branches of the graph. Eager
    forwards stay on one stream: at batch 1 they are bound by host time, not by the GPU's idle
    SMs, and a prefill on a stream of its own (a decode worker's local prefill, possibly in a
    green context of a few SMs) must not spill work onto an ordinary stream."""
    before = getattr(_BRANCHING, "on", False)
    _BRANCHING.on = True
    try:
        yield
    finally:
        _BRANCHING.on = before


def branching() -> bool:
    """Whether this thread is inside `shared_experts_beside`."""
    return getattr(_BRANCHING, "on", False)


class RMSNorm(nn.Module):
    """RMSNorm as HF: normalise in float32, cast back, then scale by `weight` [dim]."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        return HOT.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim] for positions [T] (HF default rope; computed in float32)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
    inv_freq = 1.0 / (theta ** exponents)  # [dim/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """Rotate x [T, heads, d] by cos/sin [T, d].

    With `interleave` (DeepSeek checkpoints store rope dims as pairs), HF first permutes the
    dims to [even..., odd...] and then applies rotate_half; q and k get the same permutation, so
    q·k is the interleaved-pair rotation of the original DeepSeek code.
    """
    if interleave:
        t, h, d = x.shape
        x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def rope_latent(q_pe: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, rank: int,
                interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The roped query part and the latent row MLA caches, from kv_a_proj_with_mqa's output.

    Args: q_pe [T, H, rope]; kv_a [T, rank + rope] (c_kv then k_pe); cos/sin [T, rope];
    norm_weight [rank] (kv_a_layernorm's). Returns (q_pe roped [T, H, rope],
    latent [T, rank + rope] = (RMSNorm(c_kv), roped k_pe)). One function so that a GPU compiles
    it into one or two kernels (engine/kernels/fused.py) instead of the four of its parts.
    """
    c_kv, k_pe = kv_a.split([rank, kv_a.shape[-1] - rank], -1)
    q_pe = apply_rope(q_pe, cos, sin, interleave)
    k_pe = apply_rope(k_pe[:, None, :], cos, sin, interleave)[:, 0]  # [T, rope]
    return q_pe, torch.cat((rms_norm(c_kv, norm_weight, eps), k_pe), dim=-1)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, context_latent: torch.Tensor,
                  positions: torch.Tensor, kv_b_weight: torch.Tensor, kv_lora_rank: int,
                  v_head_dim: int, softmax_scale: float) -> torch.Tensor:
    """Causal MLA attention of one sequence's queries over its context latents.

    Args:
        q_nope: [T, H, qk_nope_head_dim] queries without rope.
        q_pe: [T, H, qk_rope_head_dim] queries, rope already applied.
        context_latent: [S, kv_lora_rank + qk_rope_head_dim] cached latents; row r = position r.
        positions: [T] absolute positions of the queries; query p sees rows 0..p (needs p < S).
        kv_b_weight: [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank] (kv_b_proj.weight).
        softmax_scale: multiplier of q·k, qk_head_dim ** -0.5 (HF `scaling`).
    Returns:
        [T, H, v_head_dim] attention output in the queries' dtype.

    Runs `F.scaled_dot_product_attention`, so the [H, T, S] score matrix is never materialised
    on a flash / memory-efficient backend (a 128K context's scores would not fit on a GPU); those
    kernels accumulate softmax in float32. A prefill chunk's queries are the last T of the S
    context rows (the KvCache contract), which is the lower-right causal mask. A bf16 / fp16
    chunk on CUDA goes to `engine.kernels.prefill_attention.prefix_causal_attention` (cuDNN,
    the prefix and the chunk's own rows apart, merged by log-sum-exp: faster than
    FlashAttention-2 at MLA's head sizes, see that module); a float32 CUDA run keeps `causal_lower_right` on the
    flash path; elsewhere a boolean [T, S] mask is passed (the reference).
    """
    s, t = context_latent.shape[0], q_nope.shape[0]
    _, h, nope = q_nope.shape
    c_kv, k_pe = context_latent.split([kv_lora_rank, context_latent.shape[1] - kv_lora_rank], -1)
    kv = F.linear(c_kv, kv_b_weight).view(s, h, nope + v_head_dim)  # [S, H, nope + v]
    k_nope, v = kv.split([nope, v_head_dim], dim=-1)
    # the rope key is shared by all heads (MQA-style): broadcast it to every head
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, T, qk]
    k = torch.cat((k_nope, k_pe[:, None, :].expand(s, h, k_pe.shape[-1])), dim=-1).transpose(0, 1)  # [H, S, qk]
    v = v.transpose(0, 1)  # [H, S, v]
    if q.is_cuda and t > 1 and q.dtype in (torch.bfloat16, torch.float16):
        # the split lower-right causal form through cuDNN (engine/kernels/prefill_attention.py)
        from engine.kernels.prefill_attention import prefix_causal_attention
        return prefix_causal_attention(q[None], k[None], v[None], softmax_scale)[0].transpose(0, 1)
    qk = q.shape[-1]
    if q.is_cuda and v_head_dim < qk:
        # flash needs one head size for q, k and v: pad v (v_head_dim <= qk_head_dim in DeepSeek)
        v = F.pad(v, (0, qk - v_head_dim))
    mask: torch.Tensor | None
    # By the KvCache contract the T new tokens are the context's last T rows, so the mask is
    # the lower-right causal one (and none at all for one query). With no prefix (T == S) it
    # is the plain causal mask, which kernels skip block by block instead of reading a mask.
    causal = False
    if t == 1:
        mask = None
    elif t == s:
        mask, causal = None, True
    elif q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(t, s)
    else:
        mask = torch.arange(s, device=positions.device)[None, :] <= positions[:, None]  # [T, S]
    # a batch dimension of 1: the fused kernels take [B, H, L, E] only
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                         scale=softmax_scale)[0]  # [H, T, v']
    return out[..., :v_head_dim].transpose(0, 1)  # [T, H, v]


def packed_mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, ctx, kv_b_weight: torch.Tensor,
                         kv_lora_rank: int, v_head_dim: int, softmax_scale: float) -> torch.Tensor:
    """`mla_attention` of several sequences at once (CUDA, bf16 / fp16): their up-projections
    in one GEMM over the packed context rows, their attention in one FlashAttention-2 varlen call
    (engine/kernels/prefill_attention.py `varlen_causal_attention`).

    Args:
        q_nope: [Tq, H, nope], q_pe: [Tq, H, rope] the sequences' queries one after the other.
        ctx: engine.kv_pool.PackedContexts (rows [R, kv_lora_rank + rope] and the offsets).
        kv_b_weight, kv_lora_rank, v_head_dim, softmax_scale: as `mla_attention`.
    Returns:
        [Tq, H, v_head_dim] in the queries' dtype; per sequence what `mla_attention` gives
        (tests/test_prefill_attention.py compares them).
    """
    from engine.kernels.prefill_attention import varlen_causal_attention
    r, h, nope = ctx.rows.shape[0], q_nope.shape[1], q_nope.shape[2]
    c_kv, k_pe = ctx.rows.split([kv_lora_rank, ctx.rows.shape[1] - kv_lora_rank], -1)
    kv = F.linear(c_kv, kv_b_weight).view(r, h, nope + v_head_dim)  # [R, H, nope + v]
    k_nope, v = kv.split([nope, v_head_dim], dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)  # [Tq, H, qk]
    k = torch.cat((k_nope, k_pe[:, None, :].expand(r, h, k_pe.shape[-1])), dim=-1)  # [R, H, qk]
    return varlen_causal_attention(q, k, v, ctx.cu_q, ctx.cu_k, ctx.used_k, ctx.max_q, ctx.max_k, softmax_scale)


def _project(x: torch.Tensor, weight: torch.Tensor, decode: bool) -> torch.Tensor:
    """x [T, in] @ weight [out, in]ᵀ: in a GPU decode step of 1 or 2 rows the Triton GEMV that
    loads its weights before waiting for the previous kernel (engine/kernels/small_gemv.py),
    otherwise F.linear."""
    if decode and x.is_cuda:
        from engine.kernels import small_gemv
        if small_gemv.takes(x, weight):
            return small_gemv.gemv(x, weight)
    return F.linear(x, weight)


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V3 report section 2.1.1); HF parameter names."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        h = c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = _linear(c.hidden_size, h * c.qk_head_dim)
        else:
            self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = _linear(c.q_lora_rank, h * c.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(c.hidden_size, c.kv_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = _linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = _linear(h * c.v_head_dim, c.hidden_size)
        self.softmax_scale = c.qk_head_dim ** -0.5
        # [q rows + kv_dim, hidden]: q_proj's (or q_a_proj's) and kv_a_proj_with_mqa's weights
        # in one tensor, theirs views of it, so both projections are one GEMM (GPU fast mode:
        # use_fused_projections); None = two GEMMs (the reference)
        self.fused_a: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], q_lens: Sequence[int], kv: KvCache,
                layer_idx: int) -> torch.Tensor:
        # x: [T, hidden] (already input_layernorm-ed) -> [T, hidden]
        c, t = self.c, x.shape[0]
        decode = getattr(kv, "attends", False)  # the GPU decode step (engine/decode_batch.py)
        if self.fused_a is not None and self._fused_a_current():
            q, kv_a = _project(x, self.fused_a, decode).split([self.fused_a.shape[0] - c.kv_dim, c.kv_dim], -1)
        else:
            q = self.first_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)  # [T, kv_dim]
        if c.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, c.num_attention_heads, c.qk_head_dim)  # [T, H, qk_head_dim]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        if decode:  # the GPU decode step: engine/decode_batch.py ropes, normalises and stores the
            # latent itself (one kernel), then attends
            o = kv.attend(layer_idx, kv_a, q_nope, q_pe, rope, self).reshape(t, -1)
            return _project(o, self.o_proj.weight, True) if self.o_proj.bias is None else self.o_proj(o)
        cos, sin = rope
        q_pe, latent = HOT.rope_latent(q_pe, kv_a, cos, sin, self.kv_a_layernorm.weight,
                                       self.kv_a_layernorm.eps, c.kv_lora_rank, c.rope_interleave)
        if getattr(kv, "pack", False) and q_nope.dtype in (torch.bfloat16, torch.float16):
            kv.write(layer_idx, latent)  # a prefill batch on CUDA: short chunks in one call
            return self.o_proj(self._packed_attention(q_nope, q_pe, positions, q_lens, kv, layer_idx).reshape(t, -1))
        contexts = kv.update(layer_idx, latent)
        outs, start = [], 0
        for n, context in zip(q_lens, contexts, strict=True):
            sl = slice(start, start + n)
            outs.append(mla_attention(q_nope[sl], q_pe[sl], context, positions[sl],
                                      self.kv_b_proj.weight, c.kv_lora_rank, c.v_head_dim,
                                      self.softmax_scale))
            start += n
        return self.o_proj(torch.cat(outs).reshape(t, -1))  # [T, H * v] -> [T, hidden]

    @property
    def first_proj(self) -> nn.Linear:
        """The projection of x that fused_a joins with kv_a_proj_with_mqa: q_proj, or q_a_proj
        with a q_lora_rank."""
        return self.q_proj if self.c.q_lora_rank is None else self.q_a_proj

    def _fused_a_current(self) -> bool:
        """Whether the two projections' weights are still views of fused_a: a deepcopy, `.to()`
        or a weight swap after use_fused_projections gives them storage of their own, and the
        stale fused_a must not be read (the two GEMMs run instead). Host-side only."""
        first = self.first_proj
        return (first.weight.data_ptr() == self.fused_a.data_ptr()
                and self.kv_a_proj_with_mqa.weight.data_ptr()
                == self.fused_a.data_ptr() + first.weight.numel() * self.fused_a.element_size())

    def _packed_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor,
                          q_lens: Sequence[int], kv, layer_idx: int) -> torch.Tensor:
        """[T, H, v]: the chunks under CUDNN_MIN_QUERIES queries in varlen calls
        (`packed_mla_attention`), each call over at most PACK_MAX_ROWS context rows (a call's
        up-projected keys and values are H × 1,280 bytes per row: chunks over long cached
        prefixes would otherwise hold them all at once), longer chunks one by one through
        `mla_attention` (cuDNN); the pieces in batch order."""
        from engine.kernels.prefill_attention import CUDNN_MIN_QUERIES, PACK_MAX_ROWS
        c = self.c
        groups: list[list[int]] = []
        rows = 0
        for i, n in enumerate(q_lens):
            if n >= CUDNN_MIN_QUERIES:
                continue
            r = kv.context_rows(i)
            if groups and rows + r <= PACK_MAX_ROWS:
                groups[-1].append(i)
                rows += r
            else:  # a context alone above the cap gets a call of its own, as per sequence
                groups.append([i])
                rows = r
        piece: dict[int, torch.Tensor] = {}
        for g in groups:
            ctx = kv.packed(layer_idx, g, q_nope)
            qn, qp = (q_nope, q_pe) if ctx.q_index is None else (q_nope[ctx.q_index], q_pe[ctx.q_index])
            out = packed_mla_attention(qn, qp, ctx, self.kv_b_proj.weight, c.kv_lora_rank, c.v_head_dim,
                                       self.softmax_scale)
            if len(g) == len(q_lens):
                return out
            for j, i in enumerate(g):
                piece[i] = out[ctx.q_offsets[j]:ctx.q_offsets[j + 1]]
        outs, start = [], 0
        for i, n in enumerate(q_lens):
            if i not in piece:
                sl = slice(start, start + n)
                piece[i] = mla_attention(q_nope[sl], q_pe[sl], kv.context(layer_idx, i, q_nope), positions[sl],
                                         self.kv_b_proj.weight, c.kv_lora_rank, c.v_head_dim, self.softmax_scale)
            outs.append(piece[i])
            start += n
        return torch.cat(outs)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); x: [T, hidden] -> [T, hidden]."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(HOT.silu_mul(self.gate_proj(x), self.up_proj(x)))


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor,
          c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid group-limited top-k routing of HF `DeepseekV3TopkRouter`, in float32.

    Args: x [T, hidden]; gate_weight [E, hidden]; bias [E] (e_score_correction_bias).
    Returns: (expert ids [T, k] int64, weights [T, k] float32). The bias only chooses experts
    (report eq. 16); the weights are the unbiased sigmoid scores, renormalised when
    norm_topk_prob, times routed_scaling_factor. Groups are ranked by the sum of their two best
    biased scores and only topk_group groups are kept. Masked experts get -inf (as DeepSeek's
    own code; HF fills 0.0, which agrees whenever the kept experts' biased scores are > 0).
    """
    t, e, g = x.shape[0], c.n_routed_experts, c.n_group
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()  # [T, E]
    choice = scores + bias.float()[None, :]  # [T, E]
    if c.topk_group < g:  # keeping every group masks nothing (M's n_group 1): two top-ks fewer
        group_scores = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(-1)  # [T, G]
        group_idx = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand(t, g, e // g).reshape(t, e)  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if c.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * c.routed_scaling_factor


HOT = HotPath()
"""Process-wide: every model of the process calls these (see HotPath)."""


class TopkRouter(nn.Module):
    """The MoE gate: `weight` [E, hidden] and buffer `e_score_correction_bias` [E] (float32)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.empty(c.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return HOT.route(x, self.weight, self.e_score_correction_bias, self.c)


class MoE(nn.Module):
    """DeepSeekMoE: routed experts weighted by the gate plus always-on shared experts."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate = TopkRouter(c)
        self.experts = nn.ModuleList(
            MLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts))
        self.shared_experts = (MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
                               if c.n_shared_experts > 0 else None)
        # the stacked form of the routed experts, and the shared ones (engine/kernels/grouped_experts.py:
        # Triton fused MoE), set by use_grouped_experts on GPU workers; None runs the per-expert loop
        # below and the shared MLP apart (the reference)
        self.grouped = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return sum_parts(x.dtype, *self.forward_parts(x))

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(routed experts' output, shared experts' output or None), each [T, hidden]: `forward`
        before its sum, which the next residual add takes instead (DecoderLayer.forward_pending).
        In the GPU fast mode (grouped experts) the sum comes whole: (routed + shared, None), in
        forwards of up to SHARED_IN_KERNEL_MAX_TOKENS tokens still per slot, [T, slots, hidden]
        float32, for `slot_sum`; a single token's in the decode graphs (CUDA) as (routed [1, k,
        hidden], shared [1, S, hidden]), both per slot (GroupedExperts.forward_branched), for
        `sum_parts`."""
        g = self.grouped
        if g is not None:
            # the GPU fast mode (engine/kernels/grouped_experts.py): routing in one kernel; up to
            # SHARED_IN_KERNEL_MAX_TOKENS the shared experts run inside the fused MoE launches
            # (one part: routed + shared), above it (a prefill) as their own GEMMs
            if g.shared is not None and x.shape[0] <= g.SHARED_IN_KERNEL_MAX_TOKENS:
                if x.shape[0] == 1 and x.is_cuda and branching():  # in the decode graphs: the shared
                    # experts beside the routing (a second stream), both per slot, summed as one
                    # by the next add + RMSNorm
                    return g.forward_branched(x, self.gate)
                # per slot: the next add + RMSNorm sums them (slot_sum), two launches fewer
                return g.forward_gated(x, self.gate, with_shared=True, sum_slots=False), None
            out = g.forward_gated(x, self.gate, with_shared=False)
            # summed here, as one part (rounded to x's dtype before the residual add, where the
            # compiled two-part add + RMSNorm did not round it): that function's one-part form is
            # the one the start-up warm-up has compiled (a two-part form first met in a long
            # prefill compiled there, for seconds)
            return (out + self.shared_experts(x) if self.shared_experts is not None else out), None
        ids, weights = self.gate(x)
        out = self.experts_forward(x, ids, weights)
        return out, (self.shared_experts(x) if self.shared_experts is not None else None)

    def experts_forward(self, x: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum of routed experts: x [T, hidden], ids/weights [T, k] -> [T, hidden].

        Accumulates in float32 like HF. Expert-parallel runtimes replace this call.
        """
        if self.grouped is not None:
            return self.grouped.forward(x, ids, weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)  # tokens routed to e, and which of their k slots
            if tok.numel():
                y = expert(x[tok]).float() * weights[tok, slot, None]
                out.index_add_(0, tok, y)
        return out.to(x.dtype)


Pending = tuple  # () or (delta,) or (routed, shared): MLP outputs not yet added to the residual stream;
# delta may be per slot, [T, slots, hidden] float32 (MoE.forward_parts), summed by slot_sum


def add_pending(x: torch.Tensor, pending: Pending) -> torch.Tensor:
    """x plus a layer's pending MLP parts, summed as MoE.forward and DecoderLayer.forward did:
    x + (routed + shared)."""
    return x + sum_parts(x.dtype, *pending) if pending else x


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); MoE from first_k_dense_replace."""

    def __init__(self, c: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # also the KvCache layer number
        self.self_attn = MLAttention(c)
        self.mlp: nn.Module = (MoE(c) if layer_idx >= c.first_k_dense_replace
                               else MLP(c.hidden_size, c.intermediate_size))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], q_lens: Sequence[int],
                kv: KvCache) -> torch.Tensor:
        # x: [T, hidden] residual stream -> [T, hidden]
        return add_pending(*self.forward_pending(x, positions, rope, q_lens, kv))

    def forward_pending(self, x: torch.Tensor, positions: torch.Tensor,
                        rope: tuple[torch.Tensor, torch.Tensor], q_lens: Sequence[int], kv: KvCache,
                        pending: Pending = ()) -> tuple[torch.Tensor, Pending]:
        """The layer with its last residual add left to the caller: (x after attention, the MLP's
        output parts) with `forward`'s result = add_pending(x, parts). `pending`: the previous
        layer's parts, not yet added to x; this layer adds them in the same kernel as its input
        RMSNorm (HOT.add_rms_norm), so consecutive layers launch one kernel per residual add and
        norm instead of two or three. The sums and their order are `forward`'s."""
        if pending:
            x, h = HOT.add_rms_norm(x, pending[0], self.input_layernorm.weight, self.input_layernorm.eps,
                                    *pending[1:])
        else:
            h = self.input_layernorm(x)
        a = self.self_attn(h, positions, rope, q_lens, kv, self.layer_idx)
        x, h = HOT.add_rms_norm(x, a, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        if isinstance(self.mlp, MoE):
            routed, shared = self.mlp.forward_parts(h)
            return x, ((routed,) if shared is None else (routed, shared))
        return x, (self.mlp(h),)


class SharedHead(nn.Module):
    """MTP output head: `norm` then `head` [vocab, hidden] (shared with lm_head by default)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = _linear(c.hidden_size, c.vocab_size)


class MTPLayer(DecoderLayer):
    """MTP module k at layer index num_hidden_layers + k (report section 2.2, eq. 21-23)."""

    def __init__(self, c: ModelConfig, layer_idx: int) -> None:
        super().__init__(c, layer_idx)
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # input order is [embedding; hidden], as the checkpoint (vLLM/SGLang concat that way)
        self.eh_proj = _linear(2 * c.hidden_size, c.hidden_size)
        self.shared_head = SharedHead(c)


class DeepseekV3Model(nn.Module):
    """`model.*`: embed_tokens, layers (main layers then MTP layers), norm."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(c, i) for i in range(c.num_hidden_layers)]
            + [MTPLayer(c, c.num_hidden_layers + k) for k in range(c.num_nextn_predict_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """The whole model. Construction leaves weights uninitialised: use `build_model` or
    `engine.loader.load_checkpoint`. `e_score_correction_bias` stays float32 in any dtype."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):  # no default init: it would cost time and global RNG draws
            self.model = DeepseekV3Model(config)
            self.lm_head = _linear(config.hidden_size, config.vocab_size)
        self.to_empty(device=device)
        self.to(dtype)
        for m in self.modules():
            if isinstance(m, TopkRouter):  # DeepSeek-V3 checkpoints keep it float32 as well
                m.e_score_correction_bias = m.e_score_correction_bias.float()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def mtp_layer(self, k: int) -> MTPLayer:
        """MTP module k (0-based). Raises IndexError when k >= num_nextn_predict_layers."""
        if not 0 <= k < self.config.num_nextn_predict_layers:
            raise IndexError(f"MTP module {k} of {self.config.num_nextn_predict_layers}")
        layer = self.model.layers[self.config.num_hidden_layers + k]
        assert isinstance(layer, MTPLayer)
        return layer

    def share_mtp_weights(self) -> None:
        """Make every MTP module use the main embedding and lm_head (report section 2.2)."""
        for k in range(self.config.num_nextn_predict_layers):
            layer = self.mtp_layer(k)
            layer.embed_tokens.weight = self.model.embed_tokens.weight
            layer.shared_head.head.weight = self.lm_head.weight

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, qk_rope_head_dim] for positions [T], in the model dtype."""
        return HOT.rope_cos_sin(positions, self.config.qk_rope_head_dim, self.config.rope_theta,
                                self.dtype)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, q_lens: Sequence[int],
                   kv: KvCache, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Main layers [start, stop) on the residual stream x [T, hidden] (a pipeline stage)."""
        _check_batch(x.shape[0], positions, q_lens)
        stop = self.config.num_hidden_layers if stop is None else stop
        rope = self.rope(positions)
        pending: Pending = ()
        for i in range(start, stop):
            x, pending = self.model.layers[i].forward_pending(x, positions, rope, q_lens, kv, pending)
        return add_pending(x, pending)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, q_lens: Sequence[int],
                kv: KvCache) -> torch.Tensor:
        """input_ids, positions [T] (T = sum(q_lens)) -> final-normed hidden [T, hidden].

        Raises ValueError when the lengths disagree.
        """
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        return self.model.norm(self.run_layers(x, positions, q_lens, kv))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (final-normed; or [hidden]) -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`logits` written into out [N, vocab] float32 (a buffer that outlives a CUDA graph's
        replay: the MTP graphs' verify logits, engine/spec_graphs.py); the same values, the
        float32 conversion landing in out instead of a new tensor. Returns out."""
        return out.copy_(self.lm_head(hidden))

    def mtp_forward(self, k: int, prev_hidden: torch.Tensor, next_ids: torch.Tensor,
                    positions: torch.Tensor, q_lens: Sequence[int], kv: KvCache) -> torch.Tensor:
        """MTP module k (report eq. 21-23) -> hidden [T, hidden], not normed (feed it to
        `mtp_logits`, or as prev_hidden to module k+1).

        Row i pairs prev_hidden[i] (main `forward` output, or module k-1's output, for the token
        at positions[i]) with next_ids[i], the token at positions[i] + 1 + k; positions are the
        prev_hidden tokens' positions, so MTP KV layer num_hidden_layers + k row p holds that
        pair for p. Raises IndexError for a bad k, ValueError for inconsistent lengths."""
        layer = self.mtp_layer(k)
        _check_batch(prev_hidden.shape[0], positions, q_lens)
        e = layer.enorm(layer.embed_tokens(next_ids))  # [T, hidden]
        h = layer.hnorm(prev_hidden)  # [T, hidden]
        x = layer.eh_proj(torch.cat((e, h), dim=-1))  # [T, 2 * hidden] -> [T, hidden]
        return layer(x, positions, self.rope(positions), q_lens, kv)

    def mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """MTP module k's hidden [N, hidden] -> logits [N, vocab] float32 via shared_head."""
        head = self.mtp_layer(k).shared_head
        return head.head(head.norm(hidden)).float()


def tied_aliases(c: ModelConfig) -> dict[str, str]:
    """Tensor names that may share (and then are saved and seeded as) another tensor:
    alias -> source. MTP embed/head alias the main ones; lm_head the embedding when tied."""
    out = {}
    if c.tie_word_embeddings:
        out["lm_head.weight"] = "model.embed_tokens.weight"
    for k in range(c.num_nextn_predict_layers):
        prefix = f"model.layers.{c.num_hidden_layers + k}"
        out[f"{prefix}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"{prefix}.shared_head.head.weight"] = "lm_head.weight"
    return out


def _check_batch(t: int, positions: torch.Tensor, q_lens: Sequence[int]) -> None:
    if positions.shape != (t,) or sum(q_lens) != t or any(n < 0 for n in q_lens):
        raise ValueError(f"batch of {t} tokens: positions shape {tuple(positions.shape)}, "
                         f"q_lens {list(q_lens)} (need positions [T] and sum(q_lens) == T)")


def _param_seed(seed: int, name: str) -> int:
    # One generator per tensor, seeded by (seed, name): the weights do not depend on the
    # construction order, the process or torch's global RNG, and a rank that builds only its
    # own experts gets exactly the same tensors.
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def init_weights(model: DeepseekV3ForCausalLM, seed: int) -> None:
    """Fill every tensor: norms 1, matrices and e_score_correction_bias N(0, initializer_range).

    Drawn in float32 on the CPU and then cast/copied, so every dtype and device gets the same
    weights (rounded). A tied alias (`tied_aliases`) is filled once, under its source's name.
    """
    std = model.config.initializer_range
    tensors = model.state_dict(keep_vars=True)
    aliases = tied_aliases(model.config)
    for name, t in tensors.items():
        if name in aliases and t is tensors[aliases[name]]:
            continue  # filled under the source's name
        if name.endswith("norm.weight"):
            t.fill_(1.0)
            continue
        g = torch.Generator().manual_seed(_param_seed(seed, name))
        t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(0.0, std, generator=g))


def build_model(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> DeepseekV3ForCausalLM:
    """A model on `device` with deterministic weights from `seed` (the same for the same seed
    in any process), in eval mode without gradients, MTP embed/head shared with the main ones."""
    model = DeepseekV3ForCausalLM(config, dtype=dtype, device=device)
    model.share_mtp_weights()
    init_weights(model, seed)
    return model.eval().requires_grad_(False)  # inference only: never record autograd
