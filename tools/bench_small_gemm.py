"""Would a Triton GEMV beat cuBLAS on a decode step's few-row projections? (It did not: run 22.)

At batch 1, config M's attention projections (the fused q/kv_a weight [3,648, 2,048] and o_proj
[2,048, 2,048], bf16) run as cuBLAS kernels tiled 64 × 8, 6.9 µs each on an H100 in the step's
profile: about half the card's bandwidth. This script times, at 1, 2 and 4 rows, cuBLAS
(F.linear, and torch.mv at one row) against a GEMV written here in Triton over a sweep of its
tiles: each program owns BLOCK_N weight rows, walks K in BLOCK_K steps (loads pipelined by
num_stages) and multiplies on the CUDA cores in float32, for all rows at once (no split-K, so
each output is one program's ordered sum). On an H100 (docs/benchmarks.md, run 22) the best
tiles took 9.55 and 7.46 µs at one row where cuBLAS took 7.72 and 5.97, and fell further behind
at 2 and 4 rows, so the decode step keeps cuBLAS; the kernel stays here, beside its
measurement, not in the engine.

Each form is timed in a CUDA graph that cycles through enough copies of the weight to exceed the
L2 cache (so weights come from HBM, as in a decode step, where a layer's weights are read once),
and checked against F.linear (largest difference relative to the output's largest value).

Usage:
    python tools/bench_small_gemm.py [--rows 1,2,4] [--shapes q_kv_a,o_proj] [--out FILE] [--max-s 240]
    TRITON_INTERPRET=1 python tools/bench_small_gemm.py --device cpu   # the kernel's results only (tiny shapes, no timing)

Prints, per shape and row count, cuBLAS's µs and the best tiles' µs with their GB/s, and the
tiles with the least µs summed over the shapes. Exit status 2 without a CUDA device (unless
--device cpu), 1 when a form's result is off.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

MAX_ROWS = 4
# (BLOCK_N, BLOCK_K, num_warps, num_stages) per BLOCK_M: the sweep's starting point
TILES: dict[int, tuple[int, int, int, int]] = {1: (16, 256, 4, 4), 2: (16, 256, 4, 4), 4: (16, 128, 4, 4)}

# name -> (N, K): config M's projections at batch 1 (hidden 2,048, 16 heads of q 192, kv_dim 576)
SHAPES = {"q_kv_a": (3648, 2048), "o_proj": (2048, 2048), "dense_gate_up": (21888, 2048),
          "dense_down": (2048, 10944), "tiny": (40, 72)}
L2_BYTES = 50 << 20  # an H100's L2; an H200 has the same
TOLERANCE = 2e-2  # bf16 outputs: a rounding step or two of the largest value


def gemv(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype, float32 sums, by the Triton kernel below (CUDA,
    or a CPU under TRITON_INTERPRET=1). M ≤ MAX_ROWS; x and w with unit stride along K.

    tiles: (BLOCK_N, BLOCK_K, num_warps, num_stages) instead of TILES[BLOCK_M] (tuning).
    Raises ValueError on more than MAX_ROWS rows or mismatched K."""
    m, k = x.shape
    n = w.shape[0]
    if not 0 < m <= MAX_ROWS or w.shape[1] != k:
        raise ValueError(f"gemv takes x [1..{MAX_ROWS}, K] and w [N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    block_m = triton.next_power_of_2(m)
    bn, bk, warps, stages = tiles or TILES[block_m]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
                                        num_warps=warps, num_stages=stages)
    return y


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        nmask = offs_n < N
        mmask = offs_m < M
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = offs_k < K - k0
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # [BN, BK]
            a = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # [BM, BK]
            acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def sweep(block_m: int) -> list[tuple[int, int, int, int]]:
    """The tiles tried for BLOCK_M rows: BLOCK_N × BLOCK_K products kept in registers within reach."""
    out = []
    for bn, bk, warps, stages in itertools.product((8, 16, 32, 64), (64, 128, 256, 512), (4, 8), (2, 4)):
        if 1024 <= block_m * bn * bk <= 16384:
            out.append((bn, bk, warps, stages))
    return out


def off(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--shapes", default="q_kv_a,o_proj")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-s", type=float, default=240.0, help="stop the sweep after this many seconds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.device == "cpu":  # the kernel against F.linear in the interpreter
        g = torch.Generator().manual_seed(0)
        n, k = SHAPES["tiny"]
        w = torch.randn(n, k, generator=g)
        bad = 0
        for m in rows_list:
            x = torch.randn(m, k, generator=g)
            for tiles in [None, (8, 64, 2, 2)]:
                e = off(gemv(x, w, tiles), F.linear(x, w))
                print(f"rows {m} tiles {tiles or 'default'}: off {e:.2e}")
                bad += e > 1e-5
        return 1 if bad else 0
    if not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    from bench_moe_router import time_call

    dev = torch.device("cuda")
    started = time.monotonic()
    results, bad = [], 0
    weights = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, -(-4 * L2_BYTES // (n * k * 2)))
        weights[name] = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    for m in rows_list:  # rows outermost, then tiles, then shapes: a cut sweep has whole tiles
        xs = {name: torch.randn(m, SHAPES[name][1], device=dev, dtype=torch.bfloat16) for name in weights}
        block_m = 1 << (m - 1).bit_length()
        forms = [("cublas", None)] + ([("mv", None)] if m == 1 else []) + [("triton", t) for t in sweep(block_m)]
        for form, tiles in forms:
            if time.monotonic() - started > args.max_s:
                break
            for name, ws in weights.items():
                x, (n, k) = xs[name], SHAPES[name]

                def call(w, form=form, tiles=tiles, x=x):
                    return (F.linear(x, w) if form == "cublas" else torch.mv(w, x[0])[None]
                            if form == "mv" else gemv(x, w, tiles))

                it = itertools.cycle(ws)
                try:
                    e = off(call(ws[0]), F.linear(x, ws[0]))
                    us = time_call(lambda: call(next(it)), len(ws), args.iters)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
                    print(f"{name} rows {m} {form} {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                bad += e > TOLERANCE
                row = {"shape": name, "n": n, "k": k, "rows": m, "form": form, "tiles": tiles,
                       "us": us, "gbps": n * k * 2 / us / 1e3, "off": e, "default": tiles == TILES.get(block_m),
                       "device": torch.cuda.get_device_name()}
                results.append(row)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    del weights
    print(f"{'shape':<14}{'rows':>5}{'cuBLAS µs':>11}{'mv µs':>8}{'default µs':>12}{'best µs':>9}{'best GB/s':>11}  best tiles")
    for name in args.shapes.split(","):
        for m in rows_list:
            mine = [r for r in results if r["shape"] == name and r["rows"] == m]
            tri = [r for r in mine if r["form"] == "triton"]
            if not tri:
                continue
            best = min(tri, key=lambda r: r["us"])
            get = lambda form: next((f"{r['us']:.2f}" for r in mine if r["form"] == form), "—")  # noqa: E731
            dflt = next((f"{r['us']:.2f}" for r in tri if r["default"]), "—")
            print(f"{name:<14}{m:>5}{get('cublas'):>11}{get('mv'):>8}{dflt:>12}{best['us']:>9.2f}"
                  f"{best['gbps']:>11.0f}  {tuple(best['tiles'])}")
    for m in rows_list:  # the tiles with the least time summed over the shapes, for TILES
        shapes = args.shapes.split(",")
        total: dict[tuple, float] = {}
        for r in results:
            if r["rows"] == m and r["form"] == "triton" and r["off"] <= TOLERANCE:
                total.setdefault(tuple(r["tiles"]), []).append(r["us"])
        full = {t: sum(v) for t, v in total.items() if len(v) == len(shapes)}
        if full:
            t = min(full, key=full.get)
            print(f"rows {m}: pick {t} ({full[t]:.2f} µs over {', '.join(shapes)})")
    if bad:
        print(f"{bad} results off by more than {TOLERANCE}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
