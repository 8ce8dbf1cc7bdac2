"""How many warps should the per-slot add + RMSNorm kernel's one program a row use?

engine/kernels/slot_norm.py sums a MoE layer's output slots, adds the residual and normalises,
one program per row. At batch 1 that is one program on one multiprocessor: run 23's profile of
config M on an H100 timed it at 4.3 µs a layer, where the two compiled kernels it replaced took
1.75 + 1.8 µs. A row's loads are latency-bound there, so more warps (more loads in flight) may
shorten it. This script times the kernel at each warp count and the compiled add + norm beside
it, in CUDA graphs of `--iters` calls or more (each call's slots and residual its own copies, cycled
past the L2 cache unless --hot), and says where a warp count gives other bits than the default.

Usage:
    python tools/bench_slot_norm.py [--rows 1,2,4,8,64] [--hidden 2048] [--slots 8] [--out FILE]
Exit status 2 without CUDA. (Warp counts may differ in a value's last bit: the row's sum of
squares runs in another order; a model's shape always takes the same count.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import slot_norm  # noqa: E402
from engine.model import add_rms_norm  # noqa: E402


def timed(fn, copies: int, iters: int) -> float:
    """µs per call of fn(i) for i cycling through copies, replayed in one CUDA graph."""
    for i in range(copies):
        fn(i)  # compile / warm up every copy's call outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / iters)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,64")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--hot", action="store_true", help="one copy of the inputs (they stay in L2)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    compiled = torch.compile(add_rms_norm, dynamic=False)
    real_warps, out = slot_norm._warps, []
    for t in (int(r) for r in args.rows.split(",")):
        per = t * args.slots * args.hidden * 4 + t * args.hidden * 2
        copies = 1 if args.hot else max(1, (200 << 20) // per)  # > 50 MB of L2 on an H100/H200
        gen = torch.Generator(device="cuda").manual_seed(t)
        xs = [torch.randn(t, args.hidden, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
        ds = [torch.randn(t, args.slots, args.hidden, device="cuda", generator=gen) for _ in range(copies)]
        w = torch.randn(args.hidden, device="cuda", generator=gen).bfloat16()
        calls = max(args.iters, copies)  # every copy read once a replay: what a replay reads is past L2
        want = slot_norm.add_slots_rms_norm(xs[0], ds[0], w, 1e-6)
        row = {"rows": t, "hidden": args.hidden, "slots": args.slots, "device": torch.cuda.get_device_name()}
        for nw in (int(x) for x in args.warps.split(",")):
            slot_norm._warps = lambda block, slots, nw=nw: nw
            got = slot_norm.add_slots_rms_norm(xs[0], ds[0], w, 1e-6)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                print(f"rows {t}: {nw} warps differ from the default {real_warps(1 << (args.hidden - 1).bit_length(), args.slots)} warps' bits (a sum in another order)", file=sys.stderr)
            row[f"kernel_{nw}w_us"] = round(timed(lambda i: slot_norm.add_slots_rms_norm(xs[i], ds[i], w, 1e-6),
                                                  copies, calls), 2)
        slot_norm._warps = real_warps
        row["default_warps"] = real_warps(1 << (args.hidden - 1).bit_length(), args.slots)
        row["compiled_us"] = round(timed(lambda i: compiled(xs[i], ds[i], w, 1e-6), copies, calls), 2)
        print(json.dumps(row), flush=True)
        out.append(row)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
