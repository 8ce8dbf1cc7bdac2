"""A MoE layer's routed experts as two Triton GEMMs over (token, expert) pairs sorted by expert.

The step's T × k (token, expert) pairs are grouped by expert on the device and each expert's
group is padded to a multiple of BLOCK_M rows (`align`: sorted pair indices, padding marked by
the value T × k, and the expert of each BLOCK_M-row block). One program computes a BLOCK_M ×
BLOCK_N tile of one expert's output, reading that expert's weight tile once for all of the
block's rows; a block past the last one used exits at once. So an expert no pair chose costs
nothing, and a decode step of a few rows per expert reads each touched expert's weights once
spread over many programs (the memory-bound regime of decode).

- `gate_up`: for each pair, h = silu(x W_gate^T) * (x W_up^T), both projections in one program
  (two accumulators over the same input tile), written at the pair's own row: [T × k, I].
- `down`: y = h W_down^T scaled by the pair's routing weight, written at the pair's row in
  float32: [T × k, hidden]; the caller sums over k in a fixed order (no atomics), so a row's
  result does not depend on which other rows share the step (seeded sampling stays
  reproducible across batches and migration).

A forward of one token (a decode step at batch 1) skips the sort: its k pairs have k distinct
experts, so the kernels take block b = pair b alone, its expert read from the routing ids
(`PAIR_BLOCKS`), one launch fewer per layer with the same result bits. Forwards of up to a
thousand tokens (decode steps) skip it too: the routing kernel lists each expert's pairs as it
routes them (`moe_router.route_grouped`, an atomic add per pair), and each block finds its
expert and tile from a prefix sum of the experts' counts (`EXPERT_BLOCKS`: the same blocks in
the same order as align's, the same grid). The sort's single program took 17 us a MoE layer at
batch 64 of the 16B config on an H200; the lists cost a zeroed counter array, and each block
a read of the E counts. Same tiles, same rows: the same result bits as the sorted blocks.

No host sync: the padded sizes are upper bounds known from the shapes, so the layer can be
captured in a CUDA graph. The design is that of the fused MoE kernels of SGLang and vLLM
(`fused_moe_kernel` with `moe_align_block_size`); the code is this project's own.

Reference: `engine.model.MoE.experts_forward`'s loop over experts (tests/test_decode_kernels.py
compares the two).
"""

from __future__ import annotations

import torch

from engine.kernels import pdl

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


def block_m_for(pairs: int, num_experts: int) -> int:
    """BLOCK_M for `pairs` (token, expert) pairs over `num_experts`: the mean rows per expert
    rounded up to 16, 32, 64 or 128 (fewer padded rows for decode, bigger tiles for prefill)."""
    mean = pairs / max(1, num_experts)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64 if mean <= 96 else 128


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows that `pairs` pairs over num_experts experts fill at most, each
    expert's group padded to whole blocks: the fused kernels' grid (known on the host)."""
    return -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)


def align(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, each group padded to a multiple of block_m.

    Args:
        flat_ids: [P] int64 expert id of each pair (P = T × k, pair p = token p // k, slot p % k);
            -1 = no expert (an expert-parallel rank's slots that other ranks compute): such a
            pair gets no row.
        num_experts: E.
        block_m: rows per block.
    Returns:
        rows [NB × block_m] int32: pair indices, each expert's group contiguous in expert order
            (pairs of one expert in their own order), padding = P;
        block_expert [NB] int32: the expert of each block, E for a block past the last used.
        NB = `max_blocks(P, E, block_m)`, an upper bound known on the host.
    """
    p = flat_ids.numel()
    dev = flat_ids.device
    nb = max_blocks(p, num_experts, block_m)
    ids = torch.where(flat_ids < 0, num_experts, flat_ids)  # no-expert pairs: a group E after the rest
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    cstart = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)  # pair indices sorted by expert, no-expert pairs last
    sorted_e = ids[order]
    routed = sorted_e < num_experts
    e_c = sorted_e.clamp(max=num_experts - 1)
    # a no-expert pair's destination is one scratch entry past the rows, dropped below
    dest = torch.where(routed, (pend - padded)[e_c] + torch.arange(p, device=dev) - cstart[e_c], nb * block_m)
    rows = torch.full((nb * block_m + 1,), p, dtype=torch.int32, device=dev)
    rows[dest] = order.to(torch.int32)
    rows = rows[:-1]
    starts = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(pend, starts, right=True).to(torch.int32)  # E past the end
    return rows, block_expert


if triton is not None:
    from engine.kernels.pdl import wait_then_release
    # P and NB (pairs, blocks) change with every batch: not specialised on, so one compile per
    # BLOCK_M serves every step (a warm-up pass compiles them all at start-up)
    @triton.jit(do_not_specialize=["P", "NB"])
    def _align_kernel(ids_ptr, rows_ptr, bexp_ptr, P, E, NB,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                      N_SHARED: tl.constexpr, BLOCK_S: tl.constexpr):
        """`align` in one program: counts per expert, their padded prefix sums, each block's
        expert, then every pair's slot = its expert's padded start + the pairs of that expert
        before it (an exclusive cumsum of the one-hot [pairs, experts] tile, chunk by chunk).
        Ids E .. E + N_SHARED - 1 (the shared experts) get a one-hot of their own, after the
        routed experts in order, so that E + 2 experts do not double the routed tile's width.
        Id -1 (no expert) matches no one-hot column and stores no row."""
        offs_e = tl.arange(0, BLOCK_E)
        offs_s = tl.arange(0, BLOCK_S)
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        counts_s = tl.zeros((BLOCK_S,), dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            e = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1).to(tl.int32)
            counts += tl.sum(((e[:, None] == offs_e[None, :]) & (offs_e < E)[None, :]).to(tl.int32), axis=0)
            counts_s += tl.sum(((e[:, None] - E == offs_s[None, :]) & (offs_s < N_SHARED)[None, :]).to(tl.int32),
                               axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pend = tl.cumsum(padded, axis=0)
        pstart = pend - padded
        padded_s = (counts_s + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pend_s = tl.sum(padded, axis=0) + tl.cumsum(padded_s, axis=0)  # after every routed expert
        pstart_s = pend_s - padded_s
        for b0 in range(0, NB, BLOCK_P):  # block b's expert: the experts ending at or before it
            offs_b = b0 + tl.arange(0, BLOCK_P)
            ends = (pend[None, :] <= offs_b[:, None] * BLOCK_M) & (offs_e[None, :] < E)
            ends_s = (pend_s[None, :] <= offs_b[:, None] * BLOCK_M) & (offs_s[None, :] < N_SHARED)
            tl.store(bexp_ptr + offs_b, tl.sum(ends.to(tl.int32), axis=1) + tl.sum(ends_s.to(tl.int32), axis=1),
                     mask=offs_b < NB)
        for r0 in range(0, NB * BLOCK_M, BLOCK_P):
            offs_r = r0 + tl.arange(0, BLOCK_P)
            tl.store(rows_ptr + offs_r, tl.zeros((BLOCK_P,), dtype=tl.int32) + P, mask=offs_r < NB * BLOCK_M)
        tl.debug_barrier()  # the padding is written before any pair's slot
        seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
        seen_s = tl.zeros((BLOCK_S,), dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            valid = offs_p < P
            e = tl.load(ids_ptr + offs_p, mask=valid, other=-1).to(tl.int32)
            onehot = ((e[:, None] == offs_e[None, :]) & (offs_e < E)[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
            before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the chunk, same expert
            dest = tl.sum(onehot * (before + (pstart + seen)[None, :]), axis=1)
            oh_s = ((e[:, None] - E == offs_s[None, :]) & (offs_s < N_SHARED)[None, :]).to(tl.int32)
            before_s = tl.cumsum(oh_s, axis=0) - oh_s
            dest += tl.sum(oh_s * (before_s + (pstart_s + seen_s)[None, :]), axis=1)
            tl.store(rows_ptr + dest, offs_p, mask=valid & (e >= 0))  # id -1: no expert, no row
            seen += tl.sum(onehot, axis=0)
            seen_s += tl.sum(oh_s, axis=0)

    @triton.jit
    def _block(rows_ptr, bexp_ptr, pid_m, P, E, E_ROUTED, TOKENS, SLOTS,
               BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr, EXPERT_BLOCKS: tl.constexpr,
               BLOCK_E: tl.constexpr):
        """(expert, rows [BLOCK_M]) of block pid_m: from `align`'s output, or with PAIR_BLOCKS
        (one token: its pairs have distinct experts) block b is pair b alone, its expert read
        from the ids themselves (bexp_ptr: the flat int64 ids; no align launch), or with
        EXPERT_BLOCKS from the routing kernel's lists (rows_ptr [E_ROUTED, TOKENS], bexp_ptr
        their counts): the blocks in align's order, each routed expert's ceil(count / BLOCK_M)
        tiles in expert order (the program finds its own from a prefix sum of the counts), then
        each shared chunk's tiles over every token (chunk j is the tokens' slot SLOTS - (E -
        E_ROUTED) + j: the routing kernel appends them last); expert E (exit) past them.
        Padding rows = P."""
        if PAIR_BLOCKS:
            e = tl.load(bexp_ptr + pid_m).to(tl.int32)
            rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, P)
        elif EXPERT_BLOCKS:
            offs_e = tl.arange(0, BLOCK_E)
            counts = tl.minimum(tl.load(bexp_ptr + offs_e, mask=offs_e < E_ROUTED, other=0), TOKENS)
            tiles = (counts + BLOCK_M - 1) // BLOCK_M
            ends = tl.cumsum(tiles, 0)  # each routed expert's last tile + 1
            routed = tl.sum(tiles, 0)
            if pid_m < routed:
                e = tl.sum((ends <= pid_m).to(tl.int32), 0)
                mine = offs_e == e
                idx = (pid_m - tl.sum(tl.where(mine, ends - tiles, 0), 0)) * BLOCK_M + tl.arange(0, BLOCK_M)
                count = tl.sum(tl.where(mine, counts, 0), 0)
                rows = tl.load(rows_ptr + e.to(tl.int64) * TOKENS + idx, mask=idx < count, other=P)
            else:  # the shared chunks' tiles (past the last one: e >= E, the block exits)
                per = (TOKENS + BLOCK_M - 1) // BLOCK_M
                b = pid_m - routed
                e = E_ROUTED + b // per
                idx = (b % per) * BLOCK_M + tl.arange(0, BLOCK_M)
                rows = tl.where(idx < TOKENS, idx * SLOTS + SLOTS - E + e, P)
        else:
            e = tl.load(bexp_ptr + pid_m)
            rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        return e, rows

    @triton.jit(do_not_specialize=["P", "TOKENS"])
    def _gate_up_kernel(x_ptr, w_ptr, sg_ptr, su_ptr, out_ptr, rows_ptr, bexp_ptr, P, E, E_ROUTED, K, I, TOP_K,
                        stride_x, stride_we, stride_wn, stride_s, stride_o, TOKENS,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PAIR_BLOCKS: tl.constexpr, EXPERT_BLOCKS: tl.constexpr, BLOCK_E: tl.constexpr,
                        PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e, rows = _block(rows_ptr, bexp_ptr, pid_m, P, E, E_ROUTED, TOKENS, TOP_K, BLOCK_M, PAIR_BLOCKS,
                         EXPERT_BLOCKS, BLOCK_E)
        if (e >= E) | (e < 0):  # past the last used block, or a pair with no expert (-1)
            return
        valid = rows < P
        tok = rows // TOP_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        nmask = offs_n < I
        x_ptrs = x_ptr + tok[:, None].to(tl.int64) * stride_x + offs_k[None, :]
        if e < E_ROUTED:  # a routed expert: its W_gate rows, then its W_up rows, in the stack
            g_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None] + offs_n[None, :] * stride_wn
            u_ptrs = g_ptrs + I * stride_wn
        else:  # shared chunk j = e - E_ROUTED: rows j*I.. of the shared MLP's own gate and up weights
            j = (e - E_ROUTED).to(tl.int64) * I
            g_ptrs = sg_ptr + offs_k[:, None] + (j + offs_n[None, :]) * stride_s
            u_ptrs = su_ptr + offs_k[:, None] + (j + offs_n[None, :]) * stride_s
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = offs_k < K - k0
            a = tl.load(x_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        # the reference rounds each projection to the model dtype before silu(g) * u
        g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        h = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32) * u
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o + offs_n[None, :]
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])

    @triton.jit(do_not_specialize=["P", "TOKENS"])
    def _down_kernel(h_ptr, w_ptr, sd_ptr, out_ptr, rows_ptr, bexp_ptr, scale_ptr, P, E, E_ROUTED, K, N,
                     stride_h, stride_we, stride_wn, stride_sd, stride_o, TOKENS, SLOTS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PAIR_BLOCKS: tl.constexpr, EXPERT_BLOCKS: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # engine/kernels/pdl.py: before any load or store
            wait_then_release()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e, rows = _block(rows_ptr, bexp_ptr, pid_m, P, E, E_ROUTED, TOKENS, SLOTS, BLOCK_M, PAIR_BLOCKS,
                         EXPERT_BLOCKS, BLOCK_E)
        if (e >= E) | (e < 0):
            return
        valid = rows < P
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        nmask = offs_n < N
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_k[None, :]
        if e < E_ROUTED:
            w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None] + offs_n[None, :] * stride_wn
        else:  # shared chunk j: columns j*K.. of the shared MLP's down weight [N, S * K]
            w_ptrs = sd_ptr + (e - E_ROUTED).to(tl.int64) * K + offs_k[:, None] + offs_n[None, :] * stride_sd
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = offs_k < K - k0
            a = tl.load(h_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(a, w, acc)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        scale = tl.load(scale_ptr + rows, mask=valid, other=0.0)
        # the expert's output in the model dtype (as the reference's expert(x)), then weighted
        y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o + offs_n[None, :]
        tl.store(o_ptrs, y, mask=valid[:, None] & nmask[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) per BLOCK_M: the fastest of a sweep on one H200 over
# the 16B config's experts (hidden 2048, I 1408, 64 experts top-6) at 1 to 8,192 tokens
# (docs/benchmarks.md); within 5 % of the best at every size measured
TILES = {16: (32, 128, 4, 4), 32: (64, 64, 4, 4), 64: (128, 64, 4, 4), 128: (128, 64, 8, 3)}


# Above this many pairs `align`'s dozen torch launches beat the one-program kernel, which walks
# the pairs serially: on an H200 (tools/profile_prefill.py) the kernel took 47 us at 1,536
# pairs, 491 us at 24,576 and 3.9 ms at 196,608 (a 32K-token chunk of 64 experts top-6: 15 % of
# that prefill), torch's launches 0.6-0.7 ms of host time at every size (hidden behind a large
# prefill's device work; not behind a decode step's, so decode stays on the kernel)
ALIGN_ONE_PROGRAM_MAX_PAIRS = 16384


# (BLOCK_P, num_warps) of the align program per BLOCK_E at a decode step's tile sizes (BLOCK_M
# up to ALIGN_DECODE_MAX_BLOCK_M: a few pairs per expert), where a sweep on a GPU picked them
# (tools/bench_moe_align.py --pick). Any choice gives the same result (integer sums), only the
# time differs; keyed by BLOCK_M, so the start-up warm-up's one call per BLOCK_M compiles them
ALIGN_DECODE_TILES: dict[int, tuple[int, int]] = {32: (128, 4), 64: (128, 8)}
ALIGN_DECODE_MAX_BLOCK_M = 32


def align_tiles(block_m: int, block_e: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps) of `align_triton` for blocks of block_m rows and a one-hot tile
    BLOCK_E wide."""
    if block_m <= ALIGN_DECODE_MAX_BLOCK_M and block_e in ALIGN_DECODE_TILES:
        return ALIGN_DECODE_TILES[block_e]
    return max(16, min(128, 8192 // block_e)), (8 if block_e > 64 else 4)


def align_triton(flat_ids: torch.Tensor, num_experts: int, block_m: int,
                 num_shared: int = 0, tiles: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`align(flat_ids, num_experts + num_shared, block_m)` as one Triton program (CUDA): the
    same rows and block experts (pairs of one expert in their own order), one launch instead of
    about a dozen. num_experts: the routed experts (the one-hot tile's width), num_shared: ids
    num_experts .. num_experts + num_shared - 1 after them; tiles: (BLOCK_P, num_warps) instead
    of `align_tiles` (tuning: the pairs taken per loop step, a power of two >= 16)."""
    p = flat_ids.numel()
    nb = max_blocks(p, num_experts + num_shared, block_m)
    rows = torch.empty(nb * block_m, dtype=torch.int32, device=flat_ids.device)
    bexp = torch.empty(nb, dtype=torch.int32, device=flat_ids.device)
    block_e = triton.next_power_of_2(num_experts)
    block_p, warps = tiles or align_tiles(block_m, block_e)
    _align_kernel[(1,)](flat_ids, rows, bexp, p, num_experts, nb, BLOCK_M=block_m, BLOCK_P=block_p,
                        BLOCK_E=block_e, N_SHARED=num_shared, BLOCK_S=max(2, triton.next_power_of_2(num_shared)),
                        num_warps=warps)
    return rows, bexp


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, tiles: tuple[int, int, int, int, int] | None = None,
                  shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  sum_slots: bool | str = True, no_expert: bool = False,
                  pairs_hint: int | None = None,
                  expert_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Routed (and shared) experts of one MoE layer (Triton, CUDA only).

    Args:
        x: [T, hidden] activations (bf16 / fp16 / fp32), contiguous.
        ids: [T, k] int64 expert ids; weights: [T, k] routing weights (any float dtype). Ids
            E .. E + S - 1 are the shared experts' chunks (below); any slot may hold one. Id -1
            is no expert: the slot's output is 0 (an expert-parallel rank's share of a token,
            engine/moe_ep.py).
        gate_up: [E, 2I, hidden] gate_proj rows then up_proj rows of each expert.
        down: [E, hidden, I].
        tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) instead of the defaults (tuning).
        shared: None, or the shared MLP's own weights (gate [S·I, hidden], up [S·I, hidden],
            down [hidden, S·I], row-major), read in place as S experts of intermediate I: chunk
            j is rows (columns of down) j·I .. (j+1)·I. The sum of the S chunks' outputs is the
            shared MLP's output (each chunk's rounded to x's dtype before the sum).
        sum_slots: False returns the per-slot outputs, [T, k, hidden] float32, for the caller
            to sum (engine.model.slot_sum, inside the next add + RMSNorm); "float32" returns
            their sum [T, hidden] in float32, not rounded to x's dtype.
        no_expert: True when ids may hold -1 (their slots' rows are zeroed first: one more
            launch, so the single-device path, which never has them, leaves them out).
        pairs_hint: the pairs expected to have an expert, for the tile size (`block_m_for`);
            default all T × k (an EP rank passes its share: most of its slots are -1).
        expert_rows: (rows [E, T] int32, counts [E] int32) from `moe_router.route_grouped`: each
            routed expert's pairs, so that no sort runs; the blocks are align's (each expert's
            tiles in expert order, found by each block from a prefix sum of the counts), the S
            shared chunks being the ids' last S slots of every token. Each pair's row is
            computed by the same tiles as with the sort, so the result is the same, bit for
            bit. Not with no_expert.
    Returns:
        [T, hidden] in x's dtype: sum over k of weight × expert(x), the sum in float32 in slot order.
    Raises:
        RuntimeError when triton is missing; ValueError when the shared weights do not split
        into chunks of I.
    """
    if triton is None:
        raise RuntimeError("fused_experts needs triton (a CUDA machine)")
    t, k = ids.shape
    if t == 0:
        return _empty_result(x, k, sum_slots)
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    sg, su, sd = shared if shared is not None else (gate_up, gate_up, down)
    n_shared = shared_chunks(shared, inter)
    e_all = e + n_shared
    p = t * k
    bm = block_m_for(p if pairs_hint is None else pairs_hint, e_all)
    bm, bn, bk, warps, stages = tiles or (bm, *TILES[bm])
    flat = ids.reshape(-1).contiguous()
    block_e = max(16, triton.next_power_of_2(e))  # the routed experts' counts, read whole by each block
    if expert_rows is not None and no_expert:
        raise ValueError("fused_experts: expert_rows lists routed pairs; ids with -1 (no_expert) need the sort")
    # one token (a decode step at batch 1): its k pairs have k distinct experts, so a block per
    # pair reads each expert's weights once, as align's blocks would, without align's launch
    pair_blocks = t == 1
    expert_blocks = expert_rows is not None and not pair_blocks
    if pair_blocks:
        rows = bexp = flat  # the ids are the blocks' experts; rows unread (block b = pair b)
        nb = p
    elif expert_blocks:  # align's grid
        rows, bexp = expert_rows
        nb = max_blocks(p, e_all, bm)
    else:
        rows, bexp = (align_triton(flat, e, bm, n_shared) if p <= ALIGN_ONE_PROGRAM_MAX_PAIRS
                      else align(flat, e_all, bm))
        nb = bexp.numel()
    h = torch.empty((p, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        x, gate_up, sg, su, h, rows, bexp, p, e_all, e, hidden, inter, k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), sg.stride(0) if shared is not None else 0, h.stride(0),
        t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PAIR_BLOCKS=pair_blocks, EXPERT_BLOCKS=expert_blocks,
        BLOCK_E=block_e, num_warps=warps, num_stages=stages, **pdl.flags())
    y = (torch.zeros if no_expert else torch.empty)((p, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(nb, triton.cdiv(hidden, bn))](
        h, down, sd, y, rows, bexp, weights.reshape(-1).float(), p, e_all, e, inter, hidden,
        h.stride(0), down.stride(0), down.stride(1), sd.stride(0) if shared is not None else 0, y.stride(0),
        t, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PAIR_BLOCKS=pair_blocks, EXPERT_BLOCKS=expert_blocks,
        BLOCK_E=block_e, num_warps=warps, num_stages=stages, **pdl.flags())
    return _slot_result(y.view(t, k, hidden), x.dtype, sum_slots)


def _slot_result(y: torch.Tensor, dtype: torch.dtype, sum_slots: bool | str) -> torch.Tensor:
    """Per-slot outputs y [T, k, hidden] float32 as `fused_experts` returns them for sum_slots."""
    if sum_slots == "float32":
        return y.sum(1)
    return y.sum(1).to(dtype) if sum_slots else y


def _empty_result(x: torch.Tensor, k: int, sum_slots: bool | str) -> torch.Tensor:
    """`fused_experts`' result for T = 0 tokens."""
    return _slot_result(torch.zeros((0, k, x.shape[1]), dtype=torch.float32, device=x.device), x.dtype, sum_slots)


def shared_chunks(shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, inter: int) -> int:
    """S: how many experts of intermediate `inter` the shared MLP's weights make (0 for None).
    Raises ValueError when they do not split so, or are not row-major."""
    if shared is None:
        return 0
    sg, su, sd = shared
    if (sg.shape != su.shape or sg.shape[0] % inter or sd.shape != (sg.shape[1], sg.shape[0])
            or any(w.stride(-1) != 1 for w in shared) or sg.stride(0) != su.stride(0)):
        raise ValueError(f"shared MLP weights gate {tuple(sg.shape)}, up {tuple(su.shape)}, down "
                         f"{tuple(sd.shape)} do not split into row-major experts of intermediate {inter}")
    return sg.shape[0] // inter


def fused_experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                            down: torch.Tensor,
                            shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            sum_slots: bool | str = True, no_expert: bool = False,
                            pairs_hint: int | None = None) -> torch.Tensor:
    """What `fused_experts` computes, in torch (any device): per pair, the expert's SwiGLU with
    each projection rounded to x's dtype, the output scaled by the routing weight in float32,
    summed over k in slot order; a slot with id -1 gives 0. Same arguments and result as
    `fused_experts` (no_expert and pairs_hint are accepted for the same signature; -1 is always
    handled)."""
    t, k = ids.shape
    if t == 0:
        return _empty_result(x, k, sum_slots)
    num_routed = gate_up.shape[0]
    inter = gate_up.shape[1] // 2
    shared_chunks(shared, inter)
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, 0)  # [T × k, hidden]: pair p is token p // k
    y = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
    scale = weights.reshape(-1).float()
    for e in torch.unique(flat).tolist():
        if e < 0:  # no expert: the slot stays 0
            continue
        sel = torch.nonzero(flat == e)[:, 0]
        if e < num_routed:
            wg, wu, wd = gate_up[e, :inter], gate_up[e, inter:], down[e]
        else:
            rows = slice((e - num_routed) * inter, (e - num_routed + 1) * inter)
            wg, wu, wd = shared[0][rows], shared[1][rows], shared[2][:, rows]
        h = torch.nn.functional.silu(xs[sel] @ wg.T) * (xs[sel] @ wu.T)
        y[sel] = (h @ wd.T).float() * scale[sel, None]
    return _slot_result(y.view(t, k, -1), x.dtype, sum_slots)
