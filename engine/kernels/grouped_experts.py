"""A MoE layer's routed experts with their weights stacked per expert.

`GroupedExperts` holds one layer's experts as two stacked tensors (the experts' own nn.Linear
weights become views of them: no second copy) and runs the routed experts of a step through
the Triton fused MoE kernels on CUDA (engine/kernels/fused_moe.py: the (token, expert) pairs
sorted by expert on the device, each touched expert's weights read once, no host sync, so the
layer can be captured in a CUDA graph). The sum over a token's k experts runs in a fixed order,
so a row's result does not depend on the other rows of the step, as long as the step stays on
one side of SHARED_IN_KERNEL_MAX_TOKENS (below it the shared experts' output is summed in float32
with the routed ones, above it rounded apart: the last bits of a row can differ between the two).

Off CUDA (tests of the fast mode's host code on a CPU; serving never runs the fast mode there)
the same computation runs in torch (`fused_moe.fused_experts_reference`).

In forwards of up to SHARED_IN_KERNEL_MAX_TOKENS tokens (every decode step) the shared experts
run in the same launches, as S more experts read in place from the shared MLP's own weights (S = the shared MLP's intermediate ÷ the routed experts'), each token's
shared slots appended after its routed ones by the routing kernel
(engine/kernels/moe_router.py): one MoE layer of a decode step is then the routing kernel (which
also lists each expert's pairs, `route_grouped`, so no sort runs; for a single token a block per
pair), the two GEMM kernels and the sum over slots, where the shared MLP alone took four
launches (gate, up, SwiGLU, down) and routing about six.

Reference: `engine.model.MoE.experts_forward`'s loop over experts plus `MoE.shared_experts`
(tests/test_decode_kernels.py, tests/test_moe_router.py and tests/test_decode_edge_cases.py
compare them).
"""

from __future__ import annotations

import threading

import torch

from engine.kernels.fused_moe import block_m_for, fused_experts, fused_experts_reference, shared_chunks
from engine.kernels.moe_router import SPLIT_PARTIALS_MAX_TOKENS, route_grouped, route_with_shared


class GroupedExperts:
    """Stacked expert weights of one MoE layer and their grouped forward.

    Args:
        gate_up: [E, 2 * I, hidden] gate_proj rows then up_proj rows of each expert.
        down: [E, hidden, I] down_proj weights.
        shared: None, or the shared MLP's (gate [S·I, hidden], up [S·I, hidden], down
            [hidden, S·I]) weights, run as experts E .. E + S - 1 (`fused_moe.fused_experts`).
    The experts' own nn.Linear weights become views of these tensors (no second copy).
    Raises ValueError when the shared weights do not split into experts of intermediate I.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor,
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        self.gate_up, self.down = gate_up, down
        self.num_experts, two_i, _ = gate_up.shape
        self.intermediate = two_i // 2
        self.shared = shared
        self.num_shared = shared_chunks(shared, self.intermediate)
        # one token's shared slots (ids E .. E + S - 1, weight 1) for `forward_branched`: made here,
        # outside any graph capture, so a step reads them without launching anything to fill them
        dev = gate_up.device
        self._shared_ids = torch.arange(self.num_experts, self.num_experts + self.num_shared, device=dev)[None]
        self._shared_ones = torch.ones((1, self.num_shared), dtype=torch.float32, device=dev)

    @staticmethod
    @torch.no_grad()
    def stack(experts: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, hidden], down [E, hidden, I]) of these MLPs, in list order; each
        expert's parameters become views of the stacks (no second copy)."""
        # filled in place: torch.stack of per-expert concatenations held a copy of every expert's
        # gate and up rows beside the stack (2/3 of a layer more at start-up)
        g0, d0 = experts[0].gate_proj.weight, experts[0].down_proj.weight
        inter = g0.shape[0]
        gate_up = torch.empty((len(experts), 2 * inter, g0.shape[1]), dtype=g0.dtype, device=g0.device)
        down = torch.empty((len(experts), *d0.shape), dtype=d0.dtype, device=d0.device)
        for i, e in enumerate(experts):
            for w, view in ((e.gate_proj.weight, gate_up[i, :inter]), (e.up_proj.weight, gate_up[i, inter:]),
                            (e.down_proj.weight, down[i])):
                view.copy_(w)
                w.data = view
        return gate_up, down

    @staticmethod
    @torch.no_grad()
    def install(moe: torch.nn.Module) -> GroupedExperts:
        """Stack moe.experts' weights and make each expert's parameters views of the stack; the
        shared MLP's weights (when moe has one whose intermediate is a multiple of the routed
        experts') join as extra experts, read where they are."""
        gate_up, down = GroupedExperts.stack(list(moe.experts))
        inter = gate_up.shape[1] // 2
        shared = None
        m = moe.shared_experts
        if m is not None and m.gate_proj.weight.shape[0] % inter == 0:
            ws = (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
            shared = ws if all(w.is_contiguous() for w in ws) else None
        return GroupedExperts(gate_up, down, shared)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                sum_slots: bool | str = True, no_expert: bool = False, pairs_hint: int | None = None) -> torch.Tensor:
        """x [T, hidden], ids [T, k] int64 expert ids, weights [T, k] float32 -> [T, hidden]
        (x's dtype; the weighted sum over k accumulates in float32, as the reference); with
        sum_slots=False the per-slot outputs [T, k, hidden] float32, with "float32" their sum
        unrounded; no_expert: ids may hold -1, slots no expert here computes; pairs_hint: the
        pairs expected to have an expert, for the tile size (`fused_experts`)."""
        run = fused_experts if x.is_cuda else fused_experts_reference
        return run(x, ids, weights, self.gate_up, self.down, shared=self.shared, sum_slots=sum_slots,
                   no_expert=no_expert, pairs_hint=pairs_hint)

    # Above this many tokens (a prefill forward) the shared experts run as their own GEMMs:
    # there the step is bound by FLOPs, which cuBLAS's dense GEMM does better than the fused
    # kernel's tiles, not by launches. A decode step's rows (batch × (1 + MTP drafts)) stay
    # below it up to --max-running 256 with k = 3 drafts; a larger one takes the GEMMs too.
    SHARED_IN_KERNEL_MAX_TOKENS = 1024
    # Forwards of 2 to this many tokens (every decode step, MTP verify steps up to --max-running
    # 256 with k = 3) take the routing kernel's per-expert pair lists (`route_grouped`) instead
    # of the sort before the fused kernels (`fused_moe.align_triton`: one program, 17 us a layer
    # at batch 64 of config M on an H200, longer with more pairs). A token alone needs neither.
    EXPERT_ROWS_MAX_TOKENS = 1024

    def forward_gated(self, x: torch.Tensor, gate: torch.nn.Module, with_shared: bool,
                      sum_slots: bool = True) -> torch.Tensor:
        """The MoE output of x [T, hidden] with its routing: the routed experts weighted by `gate`
        (the engine.model.TopkRouter), plus the shared experts in the same launches when
        with_shared (which needs `shared`): one routing launch and the fused experts' launches.
        [T, hidden] in x's dtype, or per slot with sum_slots=False (as `forward`)."""
        num_shared = self.num_shared if with_shared else 0
        if not (x.is_cuda and 1 < x.shape[0] <= self.EXPERT_ROWS_MAX_TOKENS and num_shared == self.num_shared):
            ids, weights = route_with_shared(x, gate.weight, gate.e_score_correction_bias, gate.c, num_shared)
            return self.forward(x, ids, weights, sum_slots)
        # the routing kernel lists each expert's pairs as it routes them: the fused kernels need no sort
        ids, weights, rows = route_grouped(x, gate.weight, gate.e_score_correction_bias, gate.c, num_shared)
        if rows is None:  # a gate the routing kernel does not run (its torch twin routed): the sort
            return self.forward(x, ids, weights, sum_slots)
        return fused_experts(x, ids, weights, self.gate_up, self.down, shared=self.shared, sum_slots=sum_slots,
                             expert_rows=rows)

    def forward_branched(self, x: torch.Tensor, gate: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """One token's MoE layer (a decode step at batch 1, CUDA) with the shared experts on a
        second stream beside the routing and the routed experts: (routed [1, k, hidden], shared
        [1, S, hidden]), both per slot in float32, which `engine.model.sum_parts` (inside the next
        add + RMSNorm) sums as the one-branch form's [1, k + S, hidden]. The same kernels compute
        each slot as in `forward_gated` with the shared slots; at batch 1 the routing's few
        programs left most of the GPU idle while the shared experts waited for them
        (tools/bench_moe_branches.py: 3.2 µs of a 64.7 µs layer of config M on an H100). In a
        CUDA graph the two streams are two branches of the graph. Raises ValueError for more
        than one token or no shared experts."""
        if x.shape[0] != 1 or self.shared is None:
            raise ValueError(f"forward_branched takes one token and a layer with shared experts; got "
                             f"{x.shape[0]} tokens, shared experts {self.shared is not None}")
        main = torch.cuda.current_stream(x.device)
        side = _side_stream(x.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                shared = fused_experts(x, self._shared_ids, self._shared_ones, self.gate_up, self.down,
                                       shared=self.shared, sum_slots=False)
            ids, weights = route_with_shared(x, gate.weight, gate.e_score_correction_bias, gate.c, 0)
            routed = fused_experts(x, ids, weights, self.gate_up, self.down, sum_slots=False)
        finally:  # joined whatever happened: a capture ending with a branch open would hide the error
            main.wait_stream(side)
        # made on the side stream, read on the main one (the next add + RMSNorm): its memory is
        # not handed to the side stream again before that read (eager steps; a graph keeps its own)
        if not torch.cuda.is_current_stream_capturing():
            shared.record_stream(main)
        return routed, shared


_side = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's second stream on `device` (a decode worker runs forwards on two threads: each
    its own, so one thread's shared experts never wait behind the other's)."""
    streams = _side.__dict__.setdefault("streams", {})
    index = torch.device(device).index
    key = torch.cuda.current_device() if index is None else index
    if key not in streams:
        streams[key] = torch.cuda.Stream(device=key)
    return streams[key]


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
        # an expert-parallel layer (engine/moe_ep.py) keeps its own grouped local experts
        if isinstance(moe, MoE) and moe.grouped is None and not getattr(moe, "expert_parallel", False):
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
    """Run one MoE layer's routing kernel (with and without the shared slots), its shared MLP on
    its own, and its routed experts at one token (the kernels' block-per-pair form) and at
    `warm_up_token_counts` (random inputs and routing; up to EXPERT_ROWS_MAX_TOKENS also routed by
    the layer's gate, the form without the sort), compiling the Triton kernels of every
    BLOCK_M before a request needs them (several seconds
    in all, which would otherwise land on the first requests' TTFT). Returns the number of calls
    (0 without a grouped MoE layer)."""
    from engine.model import MoE

    def stacked(m):  # a layer's grouped experts: its own, or an expert-parallel rank's local ones
        return m.grouped if m.grouped is not None else getattr(m.experts_forward, "grouped", None)

    moe = next((m for m in model.modules() if isinstance(m, MoE) and stacked(m) is not None), None)
    if moe is None:
        return 0
    g = stacked(moe)
    experts, slots = g.num_experts + g.num_shared, moe.gate.c.num_experts_per_tok + g.num_shared
    counts = [1, *warm_up_token_counts(experts, slots)]  # 1: a prefill of one token, an eager decode step
    gen = torch.Generator(device=g.gate_up.device).manual_seed(0)
    x = torch.randn(2, g.gate_up.shape[2], device=g.gate_up.device, dtype=g.gate_up.dtype, generator=gen)
    # the routing kernel's variants: prefill's and decode's, and with a split gate GEMM both of
    # its forms (partial sums in a launch of their own up to SPLIT_PARTIALS_MAX_TOKENS, above it not)
    for t in (2, SPLIT_PARTIALS_MAX_TOKENS + 1):
        xt = torch.randn(t, g.gate_up.shape[2], device=g.gate_up.device, dtype=g.gate_up.dtype, generator=gen)
        for shared in {0, g.num_shared}:
            route_with_shared(xt, moe.gate.weight, moe.gate.e_score_correction_bias, moe.gate.c, shared)
    if moe.shared_experts is not None:  # its own GEMMs and compiled SwiGLU, which a long prefill runs
        moe.shared_experts(x)
    for t in counts:
        x = torch.randn(t, g.gate_up.shape[2], device=g.gate_up.device, dtype=g.gate_up.dtype, generator=gen)
        ids = torch.randint(0, experts, (t, slots), device=x.device, generator=gen)
        g.forward(x, ids, torch.ones(ids.shape, device=x.device))
        # a decode step's form, the routing kernel's pair lists, at this BLOCK_M wherever a forward
        # of up to EXPERT_ROWS_MAX_TOKENS reaches it (not an expert-parallel rank's local experts:
        # their layer routes over every rank's)
        listed = min(t, g.EXPERT_ROWS_MAX_TOKENS)
        if 1 < listed and moe.grouped is g and block_m_for(listed * slots, experts) == block_m_for(t * slots, experts):
            g.forward_gated(x[:listed], moe.gate, with_shared=g.num_shared > 0)
    return len(counts)
