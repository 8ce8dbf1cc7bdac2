"""A MoE layer's per-slot output summed into the residual stream, and the next RMSNorm, in one
Triton kernel.

In a decode step each MoE layer leaves its output per slot, [T, slots, hidden] float32 (the
routed experts' k slots and the shared experts' S after them: engine/kernels/fused_moe.py with
sum_slots=False), and the next layer's input RMSNorm sums them into the residual stream first
(engine.model.add_rms_norm with a per-slot delta). Compiled by torch.compile that was two
kernels a layer (a reduction over the slots, then one over the hidden size: inductor does not
put two reductions over different axes in one kernel), 1.8 µs each at batch 1 on an H100
(docs/bench/profile_decode_M_run22_h100.jsonl, 25 MoE layers of config M). Here one program per
row sums the row's slots in registers, adds the residual, stores it, and normalises it.

A one-token MoE layer run in two branches (GroupedExperts.forward_branched) leaves two per-slot
tensors, the routed experts' and the shared experts'; they are summed as one tensor of both's
slots, in that order.

The arithmetic is the plain function's (engine.model.add_rms_norm, the reference): the slots'
float32 sum rounded to the model dtype, added to x and rounded, the RMSNorm of that in float32
rounded, times the weight, rounded. The order of the float32 sums (over slots, and over the
hidden size for the mean square) and the GPU's rsqrt may differ from torch's: a float32 ulp,
which can move a bf16 value by a rounding step. (The compiled function it replaces added the
slots' sum to the residual before rounding it, so served values can differ from before in rare
last bits.)
tests/test_slot_norm.py compares the two, on CUDA and in Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernels import pdl

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


def _per_slot(x: torch.Tensor, d: torch.Tensor | None) -> bool:
    return (d is not None and d.dim() == 3 and d.dtype == torch.float32 and d.shape[0] == x.shape[0]
            and d.shape[2] == x.shape[1] and d.stride(2) == 1)


# A row's slot values the program holds at once (next power of two of hidden × slots): config M's
# 2,048 × 8 and up to 4,096 × 8 compile without spills on sm_90a; 8,192 × 8 (a 7,168-wide model)
# spilled even at 16 warps, and takes the compiled function instead
MAX_ROW_VALUES = 32768


def takes(x: torch.Tensor, delta: torch.Tensor, delta2: torch.Tensor | None,
          weight: torch.Tensor | None = None) -> bool:
    """Whether `add_slots_rms_norm` runs for these arguments of add_rms_norm (host-side only):
    a per-slot float32 delta on CUDA, and beside it nothing or a second per-slot one (a one-token
    MoE layer's shared experts, GroupedExperts.forward_branched), rows of unit stride, within
    MAX_ROW_VALUES; weight (when given) contiguous in x's dtype (another dtype would promote the
    plain function's result)."""
    if weight is not None and not (weight.dtype == x.dtype and weight.is_contiguous()):
        return False
    return (triton is not None and x.dim() == 2 and x.is_cuda and x.stride(1) == 1 and _per_slot(x, delta)
            and (delta2 is None or _per_slot(x, delta2))
            and triton.next_power_of_2(x.shape[1]) * (delta.shape[1] + (0 if delta2 is None else delta2.shape[1]))
            <= MAX_ROW_VALUES)


def add_slots_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                       delta2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + delta summed over its slots (then delta2's, as one tensor of
    both's slots), both [T, hidden] in x's dtype.

    x [T, hidden]; delta, delta2 [T, slots, hidden] float32; weight [hidden]. CUDA, or a CPU
    under TRITON_INTERPRET=1. Raises ValueError on shapes add_rms_norm would not take."""
    t, hidden = x.shape
    if not _per_slot(x, delta) or (delta2 is not None and not _per_slot(x, delta2)) or weight.shape != (hidden,):
        raise ValueError(f"add_slots_rms_norm takes x [T, H], delta [T, slots, H] float32 (and delta2 so), "
                         f"weight [H]; got {tuple(x.shape)}, {tuple(delta.shape)}, "
                         f"{None if delta2 is None else tuple(delta2.shape)}, {tuple(weight.shape)}")
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = torch.empty_like(s)
    if t == 0:
        return s, h
    block = triton.next_power_of_2(hidden)
    d2 = delta if delta2 is None else delta2  # unread without delta2 (SLOTS2 = 0)
    slots2 = 0 if delta2 is None else delta2.shape[1]
    _add_slots_rms_norm_kernel[(t,)](x, delta, d2, weight, s, h, hidden, x.stride(0), delta.stride(0),
                                     delta.stride(1), d2.stride(0), d2.stride(1), eps, SLOTS=delta.shape[1],
                                     SLOTS2=slots2, BLOCK=block, num_warps=_warps(block, delta.shape[1] + slots2), **pdl.flags())
    return s, h


def _warps(block: int, slots: int) -> int:
    """Warps of a row's program: a thread holds about 32 values of the unrolled slot loads, up to
    16 warps. A row's loads are latency-bound, so more of them in flight is what shortens it:
    config M (2,048 × 8) at 16 warps took 1.88 µs a call at 1 row and 4.0 µs at 64 on an H100,
    at 4 warps 3.04 and 6.55 (tools/bench_slot_norm.py, run 23; 4 warps held 128 values a
    thread, 176 registers, and 4,096 × 8 spilled)."""
    return min(16, max(4, triton.next_power_of_2(block * slots // 1024)))


def dispatching(plain: Callable) -> Callable:
    """add_rms_norm that runs `add_slots_rms_norm` where it `takes` the arguments and `plain`
    (the compiled add_rms_norm) otherwise: the function engine.model.HOT.add_rms_norm holds on
    GPU workers."""
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     delta2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if takes(x, delta, delta2, weight):
            return add_slots_rms_norm(x, delta, weight, eps, delta2)
        return plain(x, delta, weight, eps, delta2)
    return add_rms_norm


if triton is not None:
    from engine.kernels.pdl import wait_then_release

    @triton.jit
    def _add_slots_rms_norm_kernel(x_ptr, d_ptr, d2_ptr, w_ptr, s_ptr, h_ptr, H, stride_x,
                                   stride_dt, stride_ds, stride_d2t, stride_d2s, eps, SLOTS: tl.constexpr,
                                   SLOTS2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        # the slot loops unrolled (SLOTS is a model's k + S, a few values): every slot's load can be
        # in flight at once, where a loop would wait for each before the next (one program a row)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(SLOTS):  # the slots in order, as the kernel wrote them
            acc += tl.load(d_ptr + row * stride_dt + j * stride_ds + offs, mask=m, other=0.0)
        for j in tl.static_range(SLOTS2):  # then the second part's (the shared experts'), as one tensor's
            acc += tl.load(d2_ptr + row * stride_d2t + j * stride_d2s + offs, mask=m, other=0.0)
        dt = s_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        s = (x + acc.to(dt).to(tl.float32)).to(dt)  # slot_sum rounds, then the residual add rounds
        tl.store(s_ptr + row * H + offs, s, mask=m)
        s32 = s.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(s32 * s32, 0) / H + eps)
        n = (s32 * r).to(dt).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * H + offs, (w * n).to(dt), mask=m)
