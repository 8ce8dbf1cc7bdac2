"""A MoE layer's routed experts as two grouped GEMMs (DESIGN.md section 12, "Grouped GEMM").

The step's (token, expert) pairs are sorted by expert on the device; each expert's rows form
one group of `torch.nn.functional.grouped_mm`, which reads each touched expert's weights once
(a dense all-experts product would read all E and do E/k times the work). No host sync: group
offsets come from a scatter-add count, so the whole layer can be captured in a CUDA graph.
The sum over a token's k experts runs in a fixed order (un-permute, then sum over k), so the
result does not depend on thread scheduling (no atomics).

Reference: `engine.model.MoE.experts_forward` (a Python loop over experts); the two agree up to
float summation order (tests/test_decode_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        t, k = ids.shape
        if t == 0:  # (a shape known on the host: no sync) the reference loop's empty result
            return torch.zeros_like(x)
        flat = ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert's group
        xs = x[order // k]  # [T * k, hidden] rows sorted by expert
        gu = F.grouped_mm(xs, self.gate_up.transpose(1, 2), offs=offs)  # [T * k, 2I]
        g, u = gu.split(self.intermediate, dim=-1)
        y = F.grouped_mm(F.silu(g) * u, self.down.transpose(1, 2), offs=offs)  # [T * k, hidden]
        unsorted = torch.empty_like(y)
        unsorted[order] = y  # back to (token, slot) order
        out = (unsorted.view(t, k, -1).float() * weights[:, :, None].float()).sum(1)
        return out.to(x.dtype)


def use_grouped_experts(model: torch.nn.Module) -> int:
    """Switch every MoE layer of model to the grouped forward; returns the number switched."""
    from engine.model import MoE

    n = 0
    for moe in model.modules():
        if isinstance(moe, MoE) and moe.grouped is None:
            moe.grouped = GroupedExperts.install(moe)
            n += 1
    return n
