"""A MoE layer's routed experts with their weights stacked per expert (DESIGN.md section 12).

`GroupedExperts` holds one layer's experts as two stacked tensors (the experts' own nn.Linear
weights become views of them: no second copy) and runs the routed experts of a step through
the Triton fused MoE kernels on CUDA (engine/kernels/fused_moe.py: the (token, expert) pairs
sorted by expert on the device, each touched expert's weights read once, no host sync, so the
layer can be captured in a CUDA graph). The sum over a token's k experts runs in a fixed order,
so a row's result does not depend on the other rows of the step.

Off CUDA (tests of the fast mode's host code on a CPU; serving never runs the fast mode there)
the same computation runs in torch (`fused_moe.fused_experts_reference`).

Reference: `engine.model.MoE.experts_forward`'s loop over experts (tests/test_decode_kernels.py
and tests/test_decode_edge_cases.py compare the two).
"""

from __future__ import annotations

import torch

from engine.kernels.fused_moe import fused_experts, fused_experts_reference


class GroupedExperts:
    """Stacked expert weights of one MoE layer and their grouped forward.

    Args:
        gate_up: [E, 2 * I, hidden] gate_proj rows then up_proj rows of each expert.
        down: [E, hidden, I] down_proj weights.
    The experts' own nn.Linear weights become views of these tensors (no second copy).
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down
        self.num_experts, two_i, _ = gate_up.shape
        self.intermediate = two_i // 2

    @staticmethod
    @torch.no_grad()
    def install(moe: torch.nn.Module) -> GroupedExperts:
        """Stack moe.experts' weights and make each expert's parameters views of the stack."""
        gate_up = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in moe.experts])
        down = torch.stack([e.down_proj.weight for e in moe.experts])
        inter = gate_up.shape[1] // 2
        for i, e in enumerate(moe.experts):
            e.gate_proj.weight.data = gate_up[i, :inter]
            e.up_proj.weight.data = gate_up[i, inter:]
            e.down_proj.weight.data = down[i]
        return GroupedExperts(gate_up, down)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids [T, k] int64 expert ids, weights [T, k] float32 -> [T, hidden]
        (x's dtype; the weighted sum over k accumulates in float32, as the reference)."""
        if x.is_cuda:
            return fused_experts(x, ids, weights, self.gate_up, self.down)
        return fused_experts_reference(x, ids, weights, self.gate_up, self.down)


def use_grouped_experts(model: torch.nn.Module) -> int:
    """Switch every MoE layer of model to the grouped forward; returns the number switched.

    On CUDA each layer's former expert weights (freed, but in per-expert blocks the next
    layer's stacks cannot reuse) are handed back to the device before the next layer is
    stacked: kept in this process's allocator cache they would be device memory that the other
    workers on the GPU cannot have (on the 16B config, 29 GB per process at the end of the
    loop: two workers on one H200 then ran out of memory at start-up). The peak stays one
    layer's stacks above the weights."""
    from engine.model import MoE

    n = 0
    for moe in model.modules():
        if isinstance(moe, MoE) and moe.grouped is None:
            moe.grouped = GroupedExperts.install(moe)
            if moe.grouped.gate_up.is_cuda:
                torch.cuda.empty_cache()
            n += 1
    return n


def warm_up_token_counts(num_experts: int, top_k: int) -> list[int]:
    """Token counts whose T × top_k pairs pick each BLOCK_M of the fused kernels once
    (`fused_moe.block_m_for`), so that a start-up pass compiles every kernel variant."""
    return [-(-num_experts * rows // top_k) for rows in (8, 24, 64, 128)]


@torch.inference_mode()
def warm_up_fused_experts(model: torch.nn.Module) -> int:
    """Run one MoE layer's routed experts at `warm_up_token_counts` (random inputs and routing),
    compiling the Triton kernels of every BLOCK_M before a request needs them (several
    seconds in all, which would otherwise land on the first requests' TTFT). Returns the number
    of calls (0 without a grouped MoE layer)."""
    from engine.model import MoE

    moe = next((m for m in model.modules() if isinstance(m, MoE) and m.grouped is not None), None)
    if moe is None:
        return 0
    g = moe.grouped
    counts = warm_up_token_counts(g.num_experts, moe.gate.c.num_experts_per_tok)
    gen = torch.Generator(device=g.gate_up.device).manual_seed(0)
    for t in counts:
        x = torch.randn(t, g.gate_up.shape[2], device=g.gate_up.device, dtype=g.gate_up.dtype, generator=gen)
        ids = torch.randint(0, g.num_experts, (t, moe.gate.c.num_experts_per_tok), device=x.device, generator=gen)
        g.forward(x, ids, torch.ones(ids.shape, device=x.device))
    return len(counts)
