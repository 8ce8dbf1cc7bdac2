"""A loaded model onto its GPU in the fast mode's weight layout, one layer at a time.

The fast mode (engine/runner.py) reads each MoE layer's routed experts as two stacked tensors
(`engine.kernels.grouped_experts.GroupedExperts`) and each MLA attention's two input projections
as one (`engine.kernels.fused.use_fused_projections`); the modules' own weights become views of
them. Made after the whole model had landed on the GPU, the stacks were built from one tensor a
weight: the CUDA caching allocator gives each tensor of 1 to 10 MiB a 20 MiB segment of its own
(a segment's rest only fits smaller tensors), so config M's 5.5 MiB expert weights held 20 MiB
per expert, 5.7 GiB of the card beyond the weights until the stacks replaced them. Two M workers
starting together on an 80 GB card (0.41 of it each) then ran out of memory in the stacking.
Moved one MoE layer or attention at a time and converted at once, a worker holds at most one
layer's loose weights beyond its own (the stacks are filled in place, no per-expert copies).
"""

from __future__ import annotations

import torch


def fast_mode(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of `dtype` on `device` runs the fast mode: CUDA, 16-bit weights and Triton
    importable (engine/kernels/mla_decode.py)."""
    from engine.kernels.mla_decode import triton
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and triton is not None


@torch.no_grad()
def to_device(model: torch.nn.Module, device: torch.device | str, fast: bool | None = None) -> torch.nn.Module:
    """Move `model` (a DeepseekV3ForCausalLM, anywhere) to `device`; where the fast mode will
    run it there, each MoE layer's experts are stacked and each attention's input projections
    fused as soon as that module lands, and the loose weights go back to the device before the
    next module moves. Elsewhere this is `model.to(device)`. `fast` overrides `fast_mode` (tests
    of the layout on a CPU). Returns the model.

    Expert-parallel layers (engine/moe_ep.py) are left to their own placement."""
    from engine.kernels.fused import use_fused_projections
    from engine.kernels.grouped_experts import use_grouped_experts
    from engine.model import MLAttention, MoE

    device = torch.device(device)
    if not (fast_mode(device, model.dtype) if fast is None else fast):
        return model.to(device)
    for m in list(model.modules()):
        if isinstance(m, MoE) and not getattr(m, "expert_parallel", False):
            m.to(device)
            if m.grouped is not None and m.grouped.gate_up.device != m.experts[0].gate_proj.weight.device:
                m.grouped = None  # stacked elsewhere: `.to()` copied the experts apart; stacked again here
            use_grouped_experts(m)  # (empties the allocator's cache after the stack)
        elif isinstance(m, MLAttention):
            use_fused_projections(m.to(device))
    # the rest (embeddings, norms, the head); a tensor already on the device stays itself
    # under `.to()`, so the views of the stacks stay views
    return model.to(device)
