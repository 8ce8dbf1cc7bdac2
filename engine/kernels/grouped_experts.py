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
    """Switch every MoE layer of model to the grouped forward; returns the number switched."""
    from engine.model import MoE

    n = 0
    for moe in model.modules():
        if isinstance(moe, MoE) and moe.grouped is None:
            moe.grouped = GroupedExperts.install(moe)
            n += 1
    return n
