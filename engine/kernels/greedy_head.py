"""A greedy step's head on GPUs: each row's argmax and its log-probability in two Triton launches
spread over the vocabulary.

`engine.sampling.greedy_batch` (argmax, then log_softmax gathered at it) is two torch reductions
of one thread block per row: at batch 1 each walks the whole vocabulary on one SM. In config M's
decode step (vocabulary 102,400) they took 22.9 µs each at batch 1 and 26.6 / 28.8 µs at
batch 64 on an H200 (docs/bench/profile_decode_M_run17.jsonl), where reading the logits once
takes about 1 µs. Here a first launch gives every (row, chunk of CHUNK ids) program its chunk's
max, first argmax and sum of exp(x − max); a second merges a row's chunks:

    token   = the first id holding the row's max (torch.argmax's choice)
    logprob = −log Σ_c sum_c · exp(max_c − max)        (= log_softmax at the argmax)

The token is torch.argmax's exactly (ties go to the lowest id; a NaN counts as the largest value,
as torch's reduction treats it, but a row holding both +inf and a later NaN gets the +inf's id);
the log-probability differs from torch's by its sums' order (float32 rounding). The reference is
`engine.sampling.greedy_batch`'s torch form, `greedy_reference` here.
"""

from __future__ import annotations

import torch

from engine.kernels import pdl

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

CHUNK = 1024  # vocabulary ids per first-launch program


def greedy_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [B] int64, log_softmax at it [B] float32) of logits [B, V], in torch."""
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]


if triton is not None:
    from engine.kernels.pdl import wait_then_release

    @triton.jit
    def _chunk_partials(L, PMax, PIdx, PSum, V, stride_l, stride_p,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        start = c * CHUNK
        m = float("-inf")
        idx = start
        s = 0.0
        for off in tl.range(start, start + CHUNK, BLOCK):
            ids = off + tl.arange(0, BLOCK)
            x = tl.load(L + b * stride_l + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)  # NaN: the largest, as torch's argmax sees it
            bm = tl.max(x, 0)
            bi = off + tl.argmax(x, 0, tie_break_left=True)
            new_m = tl.maximum(m, bm)
            # the block's ids all follow the earlier blocks': a tie keeps the earlier id
            idx = tl.where(bm > m, bi, idx)
            safe = tl.where(new_m == float("-inf"), 0.0, new_m)
            s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), 0)
            m = new_m
        tl.store(PMax + b * stride_p + c, m)
        tl.store(PIdx + b * stride_p + c, idx)
        tl.store(PSum + b * stride_p + c, s)

    @triton.jit
    def _merge(PMax, PIdx, PSum, Tok, LogP, C, stride_p, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_C)
        cm = offs < C
        pm = tl.load(PMax + b * stride_p + offs, mask=cm, other=float("-inf"))
        pi = tl.load(PIdx + b * stride_p + offs, mask=cm, other=0)
        ps = tl.load(PSum + b * stride_p + offs, mask=cm, other=0.0)
        m = tl.max(pm, 0)
        first = tl.min(tl.where(pm == m, offs, BLOCK_C), 0)  # the first chunk holding the max
        tok = tl.sum(tl.where(offs == first, pi, 0), 0)
        safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.where(cm, ps * tl.exp(pm - safe), 0.0), 0)
        tl.store(Tok + b, tok.to(tl.int64))
        tl.store(LogP + b, -tl.log(total))


def greedy_head(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_reference` of logits [B, V] (float32, bf16 or fp16; rows may be strided) in two
    Triton launches: (tokens [B] int64, log-probabilities [B] float32). Scratch [B, ceil(V /
    CHUNK)] buffers come per call (from the graph's pool inside a CUDA graph).

    Raises RuntimeError when triton is not installed, ValueError for a logits tensor that is
    not [B, V] with V >= 1."""
    if triton is None:
        raise RuntimeError("greedy_head needs triton (pip install triton; it ships with CUDA torch)")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits {tuple(logits.shape)}: need [B, V] with V >= 1")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    chunks = triton.cdiv(v, CHUNK)
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logprobs
    pmax = torch.empty((b, chunks), dtype=torch.float32, device=logits.device)
    psum = torch.empty_like(pmax)
    pidx = torch.empty((b, chunks), dtype=torch.int32, device=logits.device)
    _chunk_partials[(b, chunks)](logits, pmax, pidx, psum, v, logits.stride(0), pmax.stride(0),
                                 CHUNK=CHUNK, BLOCK=256, num_warps=4, **pdl.flags())
    _merge[(b,)](pmax, pidx, psum, tokens, logprobs, chunks, pmax.stride(0),
                 BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=4, **pdl.flags())
    return tokens, logprobs
