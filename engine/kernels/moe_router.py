"""A forward's MoE routing in one Triton kernel (two with a split gate GEMM at a few tokens), with
the shared experts' slots appended.

`engine.model.route` (sigmoid scores of a float32 gate GEMM, the bias-corrected choice,
group-limited top-k, renormalised weights times routed_scaling_factor) runs as about half a
dozen kernels even compiled: the float32 casts, the GEMM (a gemv and its reduction at batch 1),
torch's top-k and the gather/normalise. In a decode step of the 16B config that is ~6 of a MoE
layer's ~15 launches, each a few microseconds for microseconds of work. `route_with_shared` does
all of it in one program per BLOCK_T tokens: the gate GEMM (bf16/fp16 inputs on tensor cores
with a float32 accumulator: each product of two bf16 values is exact in float32, so only the
order of the sums differs from the reference's float32 GEMM; float32 inputs in IEEE float32),
sigmoid, bias, the group mask, k rounds of arg-max, the weights; and it writes the shared
experts' slots after the routed ones (expert ids E, E + 1, ..., weight 1.0), so that the fused
MoE kernels run the shared experts as extra experts of the same launch
(engine/kernels/grouped_experts.py).

Reference: `route_with_shared_reference` (= `engine.model.route` plus the appended slots), which
also serves where the kernel does not (CPU, or a group-limited gate whose expert count is not a
power of two of at least 16, such as the shipped 8-expert models'). A prefill's tokens take the kernel too (one program per 16 tokens, each reading
the gate weight from L2): one path for every step, compiled by the start-up warm-up, where a
second path for long batches compiled lazily stalled the first requests by seconds.
tests/test_moe_router.py
compares the two on the GPU: the same experts wherever the reference's k-th and (k+1)-th
choices are not within float rounding of each other, and the weights within 1e-5.
"""

from __future__ import annotations

import torch

from engine.kernels import pdl

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

BLOCK_T = 16  # tokens per program (tl.dot's smallest M)
# With a split gate GEMM, up to this many tokens its SPLIT partial sums come from programs of their
# own (a scratch of SPLIT × T × BLOCK_E float32: 4 MB at 256 tokens of a 256-expert gate, SPLIT
# 16); above it the routing program sums the same splits in the same order itself (the same bits:
# a forward of many tokens has programs enough, and a prefill's scratch would be gigabytes)
SPLIT_PARTIALS_MAX_TOKENS = 256

if triton is not None:
    from engine.kernels.pdl import wait_then_release
    @triton.jit
    def _gate_gemm(x_ptr, w_ptr, offs_t, tmask, offs_e, emask, k_lo, k_hi, stride_x, stride_w,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """[BLOCK_T, BLOCK_E] float32: x[offs_t, k_lo:k_hi] @ w[offs_e, k_lo:k_hi]^T."""
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < k_hi
            a = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_x + kk[None, :],
                        mask=tmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + offs_e[None, :] * stride_w + kk[:, None],
                        mask=emask[None, :] & kmask[:, None], other=0.0)  # [BK, BE]
            if IEEE:  # float32 weights (tests): no TF32 rounding of the inputs
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:  # bf16/fp16 products are exact in the float32 accumulator: tensor cores
                acc = tl.dot(a, w, acc)
        return acc

    @triton.jit(do_not_specialize=["T"])
    def _gate_partial_kernel(x_ptr, w_ptr, part_ptr, T, H, K_SPLIT, stride_x, stride_w, E: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                             IEEE: tl.constexpr, PDL: tl.constexpr):
        """Split-K gate GEMM: program (t, s) writes its 16 tokens' logits over hidden columns
        s·K_SPLIT .. (s+1)·K_SPLIT to part[s] ([SPLIT, T, BLOCK_E] float32), so that a few tokens'
        256 KB gate weight is read by SPLIT programs at once instead of one."""
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        s = tl.program_id(1)
        offs_e = tl.arange(0, BLOCK_E)
        tmask = offs_t < T
        emask = offs_e < E
        k_lo = s * K_SPLIT
        acc = _gate_gemm(x_ptr, w_ptr, offs_t, tmask, offs_e, emask, k_lo, tl.minimum(k_lo + K_SPLIT, H),
                         stride_x, stride_w, BLOCK_T, BLOCK_E, BLOCK_K, IEEE)
        o = (s.to(tl.int64) * T + offs_t[:, None]) * BLOCK_E + offs_e[None, :]
        tl.store(part_ptr + o, acc, mask=tmask[:, None])

    @triton.jit(do_not_specialize=["T"])
    def _route_kernel(x_ptr, w_ptr, bias_ptr, ids_ptr, wout_ptr, part_ptr, T, H, stride_x, stride_w, stride_o,
                      scale, E: tl.constexpr, BLOCK_E: tl.constexpr, G: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr,
                      BLOCK_SLOTS: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, K_SPLIT,
                      PARTIALS: tl.constexpr, rows_ptr, counts_ptr, GROUP: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_e = tl.arange(0, BLOCK_E)
        tmask = offs_t < T
        emask = offs_e < E
        if SPLIT == 0:  # the whole gate GEMM in this program
            acc = _gate_gemm(x_ptr, w_ptr, offs_t, tmask, offs_e, emask, 0, H, stride_x, stride_w,
                             BLOCK_T, BLOCK_E, BLOCK_K, IEEE)
        else:  # split-K: each split's sum from zero, the splits added in order (batch-invariant)
            acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                if PARTIALS:  # computed by _gate_partial_kernel's SPLIT programs (a few tokens)
                    o = (T.to(tl.int64) * s + offs_t[:, None]) * BLOCK_E + offs_e[None, :]
                    acc += tl.load(part_ptr + o, mask=tmask[:, None], other=0.0)
                else:  # the same sums here (many tokens: no scratch of T × SPLIT rows)
                    k_lo = s * K_SPLIT
                    acc += _gate_gemm(x_ptr, w_ptr, offs_t, tmask, offs_e, emask, k_lo,
                                      tl.minimum(k_lo + K_SPLIT, H), stride_x, stride_w,
                                      BLOCK_T, BLOCK_E, BLOCK_K, IEEE)
        scores = tl.sigmoid(acc)  # [BT, BE]
        bias = tl.load(bias_ptr + offs_e, mask=emask, other=0.0)
        choice = scores + bias[None, :]
        # a token whose hidden state holds a NaN: its choices below every real one, so that its
        # k picks are still k distinct experts < E (argmax has no NaN order: it would pick one
        # expert k times, or a padding column, and the pair lists assume neither)
        choice = tl.where(choice == choice, choice, -1.0e38)  # two of them still sum to a finite group score
        choice = tl.where(emask[None, :], choice, float("-inf"))
        if TOPK_GROUP < G:  # keep the topk_group groups whose two best choices sum highest
            EG: tl.constexpr = BLOCK_E // G  # BLOCK_E == E here (the wrapper checks)
            c3 = tl.reshape(choice, (BLOCK_T, G, EG))
            best = tl.argmax(c3, axis=2, tie_break_left=True)  # [BT, G]
            offs_eg = tl.arange(0, EG)
            first = offs_eg[None, None, :] == best[:, :, None]
            group_score = tl.max(c3, axis=2) + tl.max(tl.where(first, float("-inf"), c3), axis=2)
            offs_g = tl.arange(0, G)
            keep = tl.zeros((BLOCK_T, G), dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                gi = tl.argmax(group_score, axis=1, tie_break_left=True)
                sel = offs_g[None, :] == gi[:, None]
                keep = tl.where(sel, 1, keep)
                group_score = tl.where(sel, float("-inf"), group_score)
            keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], (BLOCK_T, G, EG)), (BLOCK_T, BLOCK_E))
            choice = tl.where(keep_e != 0, choice, float("-inf"))
        offs_s = tl.arange(0, BLOCK_SLOTS)
        slot_ids = tl.zeros((BLOCK_T, BLOCK_SLOTS), dtype=tl.int64)
        slot_w = tl.zeros((BLOCK_T, BLOCK_SLOTS), dtype=tl.float32)
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for i in tl.static_range(TOP_K):
            ei = tl.argmax(choice, axis=1, tie_break_left=True)  # [BT]
            sel = offs_e[None, :] == ei[:, None]
            wi = tl.sum(tl.where(sel, scores, 0.0), axis=1)
            choice = tl.where(sel, float("-inf"), choice)
            here = offs_s[None, :] == i
            slot_ids = tl.where(here, ei[:, None].to(tl.int64), slot_ids)
            slot_w = tl.where(here, wi[:, None], slot_w)
            total += wi
            if GROUP:  # the pair (token, slot i) into its expert's rows, at the next free place
                ok = tmask & (ei < E)  # always (distinct experts < E, above): bounds kept regardless
                place = tl.atomic_add(counts_ptr + ei, tl.full((BLOCK_T,), 1, tl.int32), mask=ok, sem="relaxed")
                tl.store(rows_ptr + ei.to(tl.int64) * T + place, (offs_t * stride_o + i).to(tl.int32),
                         mask=ok & (place < T))
        if NORM:
            slot_w = slot_w / (total[:, None] + 1e-20)
        slot_w = slot_w * scale
        shared = (offs_s >= TOP_K)[None, :]  # slots TOP_K.. are the shared experts E, E + 1, ...
        slot_ids = tl.where(shared, (E + offs_s - TOP_K)[None, :].to(tl.int64), slot_ids)
        slot_w = tl.where(shared, 1.0, slot_w)
        o = offs_t[:, None].to(tl.int64) * stride_o + offs_s[None, :]
        omask = tmask[:, None] & (offs_s < TOP_K + N_SHARED)[None, :]
        tl.store(ids_ptr + o, slot_ids, mask=omask)
        tl.store(wout_ptr + o, slot_w, mask=omask)


def route_with_shared_reference(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, c,
                                num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.model.HOT.route` with num_shared slots appended per token.

    Args: x [T, hidden]; gate_weight [E, hidden]; bias [E] float32; c the ModelConfig;
    num_shared: slots to append (expert ids E .. E + num_shared - 1, weight 1.0).
    Returns: (ids [T, k + num_shared] int64, weights [T, k + num_shared] float32).
    """
    from engine.model import HOT
    ids, weights = HOT.route(x, gate_weight, bias, c)
    if not num_shared:
        return ids, weights
    t, e = x.shape[0], c.n_routed_experts
    shared_ids = torch.arange(e, e + num_shared, device=ids.device).expand(t, num_shared)
    return (torch.cat((ids, shared_ids), dim=1),
            torch.cat((weights, weights.new_ones(t, num_shared)), dim=1))


def kernel_applies(x: torch.Tensor, c) -> bool:
    """Whether `route_with_shared` runs the Triton kernel for x [T, hidden] and config c."""
    e = c.n_routed_experts
    grouped_ok = c.topk_group >= c.n_group or (e & (e - 1) == 0 and e % c.n_group == 0
                                                and e // c.n_group >= 2 and e >= 16)
    return triton is not None and x.is_cuda and grouped_ok and c.num_experts_per_tok <= e


def default_tiles(block_e: int) -> tuple[int, int, int, int]:
    """(BLOCK_K, num_warps, num_stages, SPLIT) of the routing kernel for BLOCK_E experts. One
    choice for every T: BLOCK_K and SPLIT set the order of the gate GEMM's sums, so a token's
    scores must not depend on how many tokens share its forward (tools/bench_moe_router.py
    sweeps the alternatives). SPLIT 0: the routing program runs the whole gate GEMM; SPLIT s > 0:
    the gate GEMM in s column ranges, each summed from zero and added in split order: up to
    SPLIT_PARTIALS_MAX_TOKENS tokens by s programs per 16 tokens first (`_gate_partial_kernel`,
    one more launch), above it by the routing program itself (the same bits)."""
    return MEASURED_TILES.get(block_e, ((64 if block_e <= 64 else 32), 4, 3, 0))


# default_tiles per BLOCK_E where a sweep on a GPU picked them (`tools/bench_moe_router.py
# --pick`: the least time over the decode sizes, T <= 256, among the choices within 25 % of the
# fastest at every larger T, so a prefill loses little); other gates keep the first kernel's tiles
MEASURED_TILES: dict[int, tuple[int, int, int, int]] = {32: (256, 4, 3, 0), 64: (128, 4, 3, 4)}


def route_with_shared(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, c, num_shared: int,
                      tiles: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of x [T, hidden] with the shared experts' slots appended: the same contract as
    `route_with_shared_reference`, one Triton launch (two with a split gate GEMM) where
    `kernel_applies` (no host sync: CUDA graph safe), the reference elsewhere. tiles: (BLOCK_K,
    num_warps, num_stages, SPLIT) instead of `default_tiles` (tuning). Raises ValueError for a
    SPLIT below 0."""
    ids, weights, _ = _route(x, gate_weight, bias, c, num_shared, tiles, group=False)
    return ids, weights


def route_grouped(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, c, num_shared: int,
                  tiles: tuple[int, int, int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`route_with_shared`, and where the kernel runs also each routed expert's pairs, for the
    fused MoE kernels to take without a sort (`fused_moe.fused_experts(expert_rows=...)`):

    rows [E, T] int32: rows[e, :counts[e]] are the flat pair indices (token × slots + slot) whose
        slot chose expert e, in no particular order (each pair takes its place with an atomic
        add: which pair lands first varies between runs, but the fused kernels compute every
        pair's row alone, so the results do not); the rest is unwritten;
    counts [E] int32: pairs per expert (one more launch: they start from zero).

    The shared experts' slots are not listed (every token has them: the fused kernels read them
    from the slot layout). Returns (ids, weights, (rows, counts)), or (ids, weights, None) where
    the kernel does not run."""
    return _route(x, gate_weight, bias, c, num_shared, tiles, group=True)


def _route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, c, num_shared: int,
           tiles: tuple[int, int, int, int] | None, group: bool
           ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The routing of `route_with_shared` / `route_grouped` (group: also the experts' rows)."""
    if not kernel_applies(x, c):
        return (*route_with_shared_reference(x, gate_weight, bias, c, num_shared), None)
    if x.dtype != gate_weight.dtype:
        x = x.to(gate_weight.dtype)
    t, hidden = x.shape
    e, k = c.n_routed_experts, c.num_experts_per_tok
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(-1) == 1 else gate_weight.contiguous()
    slots = k + num_shared
    ids = torch.empty(t, slots, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, slots, dtype=torch.float32, device=x.device)
    grouped = (torch.empty(e, t, dtype=torch.int32, device=x.device),
               torch.zeros(e, dtype=torch.int32, device=x.device)) if group else None
    if t == 0:
        return ids, weights, grouped
    block_e = max(16, triton.next_power_of_2(e))
    block_k, warps, stages, split = tiles or default_tiles(block_e)
    if split < 0:
        raise ValueError(f"routing kernel SPLIT must be >= 0, got {split}")
    ieee = x.dtype == torch.float32 or gate_weight.dtype == torch.float32
    blocks = triton.cdiv(t, BLOCK_T)
    part = ids  # unread without partials
    # each split a whole number of BLOCK_K columns; trailing splits past the hidden size add zeros
    k_split = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k if split else hidden
    partials = 0 < split and t <= SPLIT_PARTIALS_MAX_TOKENS
    if partials:
        part = torch.empty(split, t, block_e, dtype=torch.float32, device=x.device)
        _gate_partial_kernel[(blocks, split)](
            x, gate_weight, part, t, hidden, k_split, x.stride(0), gate_weight.stride(0), E=e, BLOCK_E=block_e,
            BLOCK_T=BLOCK_T, BLOCK_K=block_k, IEEE=ieee, num_warps=warps, num_stages=stages, **pdl.flags())
    _route_kernel[(blocks,)](
        x, gate_weight, bias.float(), ids, weights, part, t, hidden, x.stride(0), gate_weight.stride(0),
        ids.stride(0), float(c.routed_scaling_factor), E=e, BLOCK_E=block_e, G=c.n_group,
        TOPK_GROUP=c.topk_group, TOP_K=k, N_SHARED=num_shared,
        BLOCK_SLOTS=max(2, triton.next_power_of_2(slots)), NORM=bool(c.norm_topk_prob),
        BLOCK_T=BLOCK_T, BLOCK_K=block_k, IEEE=ieee, SPLIT=split, K_SPLIT=k_split, PARTIALS=partials,
        rows_ptr=grouped[0] if group else ids, counts_ptr=grouped[1] if group else ids, GROUP=group,
        num_warps=warps, num_stages=stages, **pdl.flags())
    return ids, weights, grouped
