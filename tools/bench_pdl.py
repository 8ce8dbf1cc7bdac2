"""What programmatic dependent launch (PDL) saves a chain of short kernels in a CUDA graph.

Usage (CUDA, compute capability 9.0 or later):
    python tools/bench_pdl.py [--kernels 300] [--sizes 256,1024,2048] [--out FILE]

Why: config M's decode step at batch 1 is 354 kernels, most of them a few µs long, and about
half of its 2.76 ms is the fixed cost of short kernels (docs/benchmarks.md, runs 22–24). With
PDL (Hopper), a kernel launched with the programmatic-serialization attribute may start while
the kernel before it in the stream is still running; it waits in `griddepcontrol.wait`
(`tl.extra.cuda.gdc_wait`) until that kernel has finished and its writes are visible. Whatever
it does before the wait overlaps the previous kernel's tail, and its launch does too.

Each chain is `--kernels` GEMVs y = W_i x in one CUDA graph, x the previous kernel's output,
each W_i [n, n] bf16 its own (the chain's weights are past the L2 cache when n ≥ 1,024), one
program per 8 rows. Variants:
- plain: ordinary launches;
- pdl: launched with `launch_pdl=True`; each kernel waits first, then lets the next launch;
- pdl_prefetch: as pdl, but each kernel loads its weight rows before it waits (weights are
  never written by the chain; the input vector is).
Per variant: µs a kernel (graph replay time / kernels, median of 20 replays) and whether its
output equals plain's bit for bit (the same arithmetic in the same order: it must). One JSON
line per (n, variant).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import JsonRows, capture, replay_us  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the GPU machine has triton
    triton = None

ROWS = 8  # output rows a program


if triton is not None:

    @triton.jit
    def _gemv(x_ptr, w_ptr, y_ptr, N: tl.constexpr, BLOCK_N: tl.constexpr, GDC: tl.constexpr,
              PREFETCH: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, N)
        if PREFETCH:  # weights: not written by any kernel of the chain, safe before the wait
            w = tl.load(w_ptr + rows[:, None] * N + ks[None, :])
        if GDC:
            tl.extra.cuda.gdc_wait()  # the previous kernel's output is visible after this
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + ks).to(tl.float32)
        if not PREFETCH:
            w = tl.load(w_ptr + rows[:, None] * N + ks[None, :])
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def chain(xs: list[torch.Tensor], ws: list[torch.Tensor], variant: str) -> None:
    """xs[i + 1] = ws[i] @ xs[i] for every i, one kernel each."""
    n = xs[0].shape[0]
    pdl = variant != "plain"
    for i, w in enumerate(ws):
        _gemv[(n // ROWS,)](xs[i], w, xs[i + 1], N=n, BLOCK_N=ROWS, GDC=pdl,
                            PREFETCH=variant == "pdl_prefetch", num_warps=4, launch_pdl=pdl)


def measure(n: int, kernels: int, variant: str, ws: list[torch.Tensor], x0: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(µs a kernel, the chain's last output) of the chain captured in one CUDA graph."""
    xs = [x0.clone()] + [torch.empty_like(x0) for _ in range(kernels)]
    graph = capture(lambda: chain(xs, ws, variant))
    return replay_us(graph, kernels), xs[-1].clone()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=300)
    ap.add_argument("--sizes", default="256,1024,2048", help="n of the [n, n] weights (multiples of 8)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if triton is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_pdl needs triton and a GPU of compute capability 9.0 or later")
    lines = JsonRows()
    for n in (int(x) for x in args.sizes.split(",")):
        g = torch.Generator(device="cuda").manual_seed(n)
        # entries of ±1/sqrt(n) keep the chain's values near 1 over hundreds of products
        ws = [(torch.randn(n, n, device="cuda", generator=g) / n ** 0.5).to(torch.bfloat16)
              for _ in range(args.kernels)]
        x0 = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        first = None
        for variant in ("plain", "pdl", "pdl_prefetch", "plain"):
            us, y = measure(n, args.kernels, variant, ws, x0)
            first = y if first is None else first
            row = {"n": n, "weight_mb": round(n * n * 2 / 2**20, 3), "kernels": args.kernels, "variant": variant,
                   "us_per_kernel": round(us, 3), "equal_to_plain": bool(torch.equal(y, first)),
                   "device": torch.cuda.get_device_name(), "triton": triton.__version__}
            lines.add(row)
        del ws
        torch.cuda.empty_cache()
    lines.write(args.out)


if __name__ == "__main__":
    main()
