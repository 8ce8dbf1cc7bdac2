"""Whether reading a GEMV's weights into the L2 cache on a second CUDA-graph branch, while short
latency-bound kernels run, shortens the GEMV.

Usage (CUDA; run 25 on an H100: the branch costs more than it saves, docs/benchmarks.md):
    python tools/bench_l2_prefetch.py [--shapes 2048x2048,3648x2048] [--fillers 4,8] [--out FILE]

Why: at batch 1 config M's decode step leaves the GPU's memory idle through its short kernels
(MLA decode, its merge, norms, routing: about half of a 2.7 ms step on an H100), while its
attention GEMVs read 15 MB (q and kv_a) and 8 MB (o_proj) a layer at about half the bandwidth
(cuBLAS, 6.9 µs each; docs/benchmarks.md, run 22). The weights do not depend on the step's data,
so a kernel on another stream could read them into L2 (50 MB on an H100) during the short
kernels before them, and the GEMV would then read L2 instead of HBM.

Each repetition (64 a graph, each with its own weight W_r, so that no repetition finds the
previous one's weights in L2) is `--fillers` dependent one-program kernels (about 2 µs each:
the short kernels' stand-in), then y = x W_rᵀ through torch's linear (cuBLAS, as the model's
projections). Variants, µs a repetition (graph replay ÷ 64, median of 20 replays):
- plain: fillers, then the GEMV;
- prefetch: the same, and at the repetition's start a fork to a second stream that reads W_r
  (every program a contiguous slice, loads kept in L2 with `eviction_policy="evict_last"`),
  joined back before the next repetition;
- fillers: the fillers alone; gemv_cold: the GEMV alone; gemv_hot: the GEMV alone on one weight
  for every repetition (L2-resident: the floor the prefetch aims at).
The GEMV's outputs with and without the prefetch are compared bit for bit (they must agree).
One JSON line per (shape, fillers, variant).
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

REPS = 64
FILLER = 256  # values a filler kernel reads and writes


if triton is not None:

    @triton.jit
    def _filler(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 0.999 + 0.001)

    @triton.jit
    def _prefetch(w_ptr, sink_ptr, numel, per_program, BLOCK: tl.constexpr):
        # read a contiguous slice into L2 and keep it there; the sum's store keeps the loads live
        start = tl.program_id(0).to(tl.int64) * per_program
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for off in range(0, per_program, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            acc += tl.load(w_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(sink_ptr + tl.program_id(0), tl.sum(acc, 0))


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def build(variant: str, ws: list[torch.Tensor], x: torch.Tensor, fillers: int, side: torch.cuda.Stream,
          buf: list[torch.Tensor], sink: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Enqueue the variant's REPS repetitions on the current stream (and `side` for prefetch)."""
    main = torch.cuda.current_stream()
    programs = 2 * _sms()
    for r in range(REPS):
        w = ws[0] if variant == "gemv_hot" else ws[r]
        if variant == "prefetch":
            side.wait_stream(main)  # fork at the repetition's start
            with torch.cuda.stream(side):
                per = -(-w.numel() // programs)
                per = -(-per // 4096) * 4096
                _prefetch[(programs,)](w, sink, w.numel(), per, BLOCK=4096, num_warps=8)
        if variant in ("plain", "prefetch", "fillers"):
            for i in range(fillers):
                _filler[(1,)](buf[i % 2], buf[(i + 1) % 2], N=FILLER, num_warps=1)
        if variant != "fillers":
            torch.mm(x, w.t(), out=outs[r])  # as F.linear: cuBLAS on the transposed weight
        if variant == "prefetch":
            main.wait_stream(side)  # join before the next repetition


def measure(variant: str, ws, x, fillers: int) -> tuple[float, list[torch.Tensor]]:
    side = torch.cuda.Stream()
    buf = [torch.ones(FILLER, device="cuda"), torch.ones(FILLER, device="cuda")]
    sink = torch.zeros(2 * _sms(), device="cuda")
    outs = [torch.empty(1, ws[0].shape[0], device="cuda", dtype=ws[0].dtype) for _ in range(REPS)]
    graph = capture(lambda: build(variant, ws, x, fillers, side, buf, sink, outs))
    return replay_us(graph, REPS), [o.clone() for o in outs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="2048x2048,3648x2048", help="N x K of the weights (o_proj; q and kv_a)")
    ap.add_argument("--fillers", default="4,8", help="short kernels before each GEMV")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("bench_l2_prefetch needs triton and a CUDA GPU")
    lines = JsonRows()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(n + k)
        ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(REPS)]
        x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
        base = {"shape": shape, "weight_mb": round(n * k * 2 / 2**20, 2), "device": torch.cuda.get_device_name()}
        for variant in ("gemv_cold", "gemv_hot"):
            us, _ = measure(variant, ws, x, 0)
            lines.add({**base, "fillers": 0, "variant": variant, "us_per_rep": round(us, 3)})
        for fillers in (int(v) for v in args.fillers.split(",")):
            ref = None
            for variant in ("fillers", "plain", "prefetch", "plain"):
                us, outs = measure(variant, ws, x, fillers)
                row = {**base, "fillers": fillers, "variant": variant, "us_per_rep": round(us, 3)}
                if variant != "fillers":
                    ref = outs if ref is None else ref
                    row["equal_to_plain"] = all(torch.equal(a, b) for a, b in zip(outs, ref))
                lines.add(row)
        del ws
        torch.cuda.empty_cache()
    lines.write(args.out)


if __name__ == "__main__":
    main()
