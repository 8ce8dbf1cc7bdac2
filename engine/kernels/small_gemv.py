"""A decode step's projections at 1 or 2 rows (the kernel takes up to 4): y = x Wᵀ as a Triton
GEMV whose programs load their weight rows before they wait for the previous kernel.

At batch 1 config M's attention projections (q and kv_a as one [3,648, 2,048] GEMM, o_proj
[2,048, 2,048], W_UV [16 heads × 128, 512]) took 6.9, 6.9 and 3.7 µs a layer through cuBLAS on an
H100, and an L2-resident weight did not make cuBLAS's GEMV faster than 5.1 µs (docs/benchmarks.md,
runs 22 and 25): what is left at one row is the kernel's fixed cost. Here a program holds
ROWS whole weight rows (all of K at once: every byte of its tile in flight in one load), and
since no kernel of a decode step writes a weight, it issues that load *before* the
programmatic-dependent-launch wait (engine/kernels/pdl.py): inside the decode graphs the weights
stream in while the previous kernel still runs, and after the wait only x (a few KB) is read.
A chain of such GEMVs ran 5.33 µs a [2,048, 2,048] kernel plainly, 4.31 with PDL and the early
load (tools/bench_pdl.py, run 25), where a cuBLAS GEMV of that shape took 6.38 µs cold.

The arithmetic: float32 products summed over K in one `tl.sum` per row, rounded once to y's
dtype, as cuBLAS's bf16 GEMM rounds its float32 accumulator; the order of the float32 sum differs
from cuBLAS's, so a value can move by a rounding step (a reference twin: `gemv_reference`).

Grouped form (W_UV): x [T, G, K], w [G, N, K] -> y [T, G, N], one GEMV per group g, in one launch.
"""

from __future__ import annotations

import torch

from engine.kernels import pdl

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

MAX_ROWS = 4  # x rows a launch takes
# x rows at which a decode step uses it: on an H100 (run 26, M's step in graphs against cuBLAS)
# batch 1 ran 6.0 % and batch 2 3.1 % faster, batch 4 1.2 % slower, so 3 and 4 rows keep cuBLAS
STEP_MAX_ROWS = 2
MAX_K = 8192  # the reduction a program holds whole
TILE_VALUES = 16384  # weight values a program loads at once (ROWS × K, 128 a thread at 4 warps)


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The twin: x [T, K] @ w [N, K]ᵀ -> [T, N], or grouped x [T, G, K], w [G, N, K] -> [T, G, N];
    float32 products and sums, rounded once to x's dtype."""
    if x.dim() == 3:
        return torch.einsum("tgk,gnk->tgn", x.float(), w.float()).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


def _shapes_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    grouped = x.dim() == 3
    return (x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.dim() in (2, 3) and w.dim() == x.dim()
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[-1] == w.shape[-1] <= MAX_K
            and x.stride(-1) == 1 and w.stride(-1) == 1 and (not grouped or x.shape[1] == w.shape[0]))


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a decode step runs `gemv` for these (host-side): CUDA tensors of one 16-bit
    dtype, 1..STEP_MAX_ROWS rows, K ≤ MAX_K, unit stride along K, triton installed."""
    return (triton is not None and x.is_cuda and w.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] <= STEP_MAX_ROWS and _shapes_ok(x, w))


def _rows(n: int, groups: int, block_k: int, sms: int) -> int:
    """Weight rows a program: TILE_VALUES // K, halved (down to 1) until the launch has at
    least two programs an SM, so a small matrix (W_UV's 2 MB) is still read by the whole card."""
    rows = max(1, TILE_VALUES // block_k)
    while rows > 1 and triton.cdiv(n, rows) * groups < 2 * sms:
        rows //= 2
    return rows


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ -> [T, N] (or grouped, see the module docstring) in x's dtype, into
    `out` when given (any strides with the last one 1; e.g. a transposed view). CUDA, or a CPU
    under TRITON_INTERPRET=1 (float32 too, for tests). Raises ValueError on shapes outside
    1..MAX_ROWS rows and K ≤ MAX_K (checked first, with or without triton), RuntimeError
    without triton."""
    if not _shapes_ok(x, w):
        raise ValueError(f"gemv takes x [1..{MAX_ROWS}, (G,) K ≤ {MAX_K}] and w [(G,) N, K] of one dtype, "
                         f"unit stride along K; got {tuple(x.shape)} {x.dtype}, {tuple(w.shape)} {w.dtype}")
    if triton is None:
        raise RuntimeError("gemv needs triton (pip install triton; it ships with CUDA torch)")
    grouped = x.dim() == 3
    xg = x if grouped else x[:, None]
    wg = w if grouped else w[None]
    t, g, k = xg.shape
    n = wg.shape[1]
    y = out if out is not None else torch.empty(t, g, n, dtype=x.dtype, device=x.device)
    yg = y if grouped else y.view(t, 1, n) if out is None else y[:, None]
    if yg.shape != (t, g, n) or yg.stride(-1) != 1:
        raise ValueError(f"gemv: out must be [{t}, {g}, {n}] (or [{t}, {n}]) with unit last stride, got "
                         f"{tuple(y.shape)} strides {tuple(y.stride())}")
    from engine.kernels.mla_decode import _sms
    block_k = triton.next_power_of_2(k)
    rows = _rows(n, g, block_k, _sms(x.device) if x.is_cuda else 132)
    _gemv_kernel[(triton.cdiv(n, rows), g)](
        xg, wg, yg, t, n, k, xg.stride(0), xg.stride(1), wg.stride(0), wg.stride(1),
        yg.stride(0), yg.stride(1), ROWS=rows, BLOCK_K=block_k, BLOCK_T=triton.next_power_of_2(t),
        num_warps=4, **pdl.flags())
    return y if grouped or out is not None else y.view(t, n)


if triton is not None:
    from engine.kernels.pdl import wait_then_release

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, T, N, K, stride_xt, stride_xg, stride_wg, stride_wn,
                     stride_yt, stride_yg, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                     PDL: tl.constexpr):
        g = tl.program_id(1).to(tl.int64)
        n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        nmask = n < N
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        # the weights: no kernel of a decode step writes them, so they load before the wait (PDL:
        # while the previous kernel still runs); everything after reads or writes the step's data
        w = tl.load(w_ptr + g * stride_wg + n[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        if PDL:  # engine/kernels/pdl.py
            wait_then_release()
        for t in tl.static_range(BLOCK_T):
            if t < T:
                x = tl.load(x_ptr + t * stride_xt + g * stride_xg + ks, mask=kmask, other=0.0).to(tl.float32)
                # the compiler keeps one float32 copy of the tile for every row (ptxas at M's
                # q + kv_a tile, 8 × 2,048: 147 registers a thread at one row, 164 at four, no spill)
                y = tl.sum(w.to(tl.float32) * x[None, :], 1)
                tl.store(y_ptr + t * stride_yt + g * stride_yg + n, y.to(y_ptr.dtype.element_ty), mask=nmask)
