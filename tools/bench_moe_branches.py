"""Would a decode step gain from running a MoE layer's shared experts beside its routing?

At batch 1 a MoE layer of config M (64 routed experts top-6, 2 shared, hidden 2,048) runs its
routing (a gate GEMM over a 256 KB weight, top-6: a few programs, latency-bound) and then the
fused experts, the shared ones as two more slots of the same launches
(engine/kernels/grouped_experts.py). The shared experts do not depend on the routing, so a
second stream could run them (about a quarter of the layer's bytes) while the routing's few
programs leave most of the GPU idle. This script times both forms of one layer in CUDA graphs,
each layer with weights of its own (so they come from HBM, as in a decode step, not from L2):

- `one branch` (what a decode step of 2 or more tokens runs): routing with the shared slots
  appended, then the fused experts over routed and shared slots;
- `two branches` (what a decode step at batch 1 runs since run 22 measured it: GroupedExperts.
  forward_branched): the shared experts alone on a second stream (forked from and joined to the
  captured stream) beside the routing and the fused experts over the routed slots, then the sum.

It prints µs per layer for each form and batch, the difference, and the two forms' largest
relative difference (the same experts; only the sums' order and rounding differ). Run 17's
profile put the batch-1 routing at 15 µs a layer (before its split-K tiles) and the whole layer
at about 49 µs against 29 µs of bytes (docs/benchmarks.md, "After run 20").

Usage:
    python tools/bench_moe_branches.py [--batch 1,4,16,64] [--layers 8] [--iters 50] [--out FILE]
    TRITON_INTERPRET=1 python tools/bench_moe_branches.py --device cpu   # the two forms agree (tiny shapes)

At batch > 1 both forms sort the (token, expert) pairs (`align`), where the decode step has the
routing list them (`route_grouped`): the batch-1 figures are the decode step's own form.
Exit status 2 without a CUDA device (unless --device cpu), 1 when the forms disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from engine.config import ModelConfig  # noqa: E402
from engine.kernels.fused_moe import fused_experts  # noqa: E402
from engine.kernels.moe_router import route_with_shared  # noqa: E402
from bench_moe_router import time_call  # noqa: E402  (µs per call of a function replayed in a CUDA graph)

# (hidden, routed experts, top-k, shared experts, moe intermediate): M, and a tiny shape for --device cpu
SHAPES = {"M": (2048, 64, 6, 2, 1408), "tiny": (64, 16, 4, 2, 32)}


@dataclasses.dataclass
class Layer:
    gate: torch.Tensor  # [E, hidden]
    bias: torch.Tensor  # [E] float32
    gate_up: torch.Tensor  # [E, 2I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [S·I, hidden], up, down [hidden, S·I]


def make_layer(hidden: int, e: int, s: int, inter: int, dtype: torch.dtype, device: str, seed: int) -> Layer:
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) / shape[-1] ** 0.5).to(dtype)
    return Layer(w(e, hidden), torch.randn(e, generator=g, device=device) * 0.01, w(e, 2 * inter, hidden),
                 w(e, hidden, inter), (w(s * inter, hidden), w(s * inter, hidden), w(hidden, s * inter)))


def one_branch(x: torch.Tensor, layer: Layer, c: ModelConfig, s: int) -> torch.Tensor:
    """The decode step's form: shared slots after the routed ones, one pair of fused launches."""
    ids, weights = route_with_shared(x, layer.gate, layer.bias, c, s)
    return fused_experts(x, ids, weights, layer.gate_up, layer.down, shared=layer.shared)


def shared_only(x: torch.Tensor, layer: Layer, e: int, s: int) -> torch.Tensor:
    """The shared experts alone: every token's slots are the S shared chunks (ids E .. E + S - 1)."""
    ids = torch.arange(e, e + s, device=x.device).expand(x.shape[0], s)
    return fused_experts(x, ids, torch.ones(ids.shape, device=x.device), layer.gate_up, layer.down,
                         shared=layer.shared)


def routed_only(x: torch.Tensor, layer: Layer, c: ModelConfig) -> torch.Tensor:
    ids, weights = route_with_shared(x, layer.gate, layer.bias, c, 0)
    return fused_experts(x, ids, weights, layer.gate_up, layer.down)


def two_branches(x: torch.Tensor, layer: Layer, c: ModelConfig, s: int, side: torch.cuda.Stream | None) -> torch.Tensor:
    """The shared experts on `side` (None: in order, on a CPU) beside the routing and routed experts."""
    if side is None:
        return routed_only(x, layer, c) + shared_only(x, layer, c.n_routed_experts, s)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ys = shared_only(x, layer, c.n_routed_experts, s)
    yr = routed_only(x, layer, c)
    torch.cuda.current_stream().wait_stream(side)
    return yr + ys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,4,16,64", help="tokens per layer call, comma-separated")
    ap.add_argument("--layers", type=int, default=8, help="layers of distinct weights per replay (HBM, not L2)")
    ap.add_argument("--iters", type=int, default=50, help="replays timed per form and batch")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (with TRITON_INTERPRET=1: agreement only)")
    ap.add_argument("--out", default="", help="JSON lines, one per batch")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_moe_branches: no CUDA device here (the timings need one); --device cpu with TRITON_INTERPRET=1 "
              "checks that the two forms agree", file=sys.stderr)
        return 2
    hidden, e, k, s, inter = SHAPES["M" if cuda else "tiny"]
    c = dataclasses.replace(ModelConfig.tiny(), hidden_size=hidden, n_routed_experts=e, num_experts_per_tok=k,
                            n_group=1, topk_group=1, n_shared_experts=s, moe_intermediate_size=inter)
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = [make_layer(hidden, e, s, inter, dtype, args.device, seed=i) for i in range(args.layers if cuda else 1)]
    side = torch.cuda.Stream() if cuda else None
    rows = []
    for t in [int(b) for b in args.batch.split(",")]:
        x = (torch.randn(t, hidden, device=args.device) * 0.5).to(dtype)
        a = [one_branch(x, layer, c, s) for layer in layers]
        b = [two_branches(x, layer, c, s, side) for layer in layers]
        if cuda:
            torch.cuda.synchronize()
        diff = max(float((y1.float() - y2.float()).norm() / y1.float().norm()) for y1, y2 in zip(a, b))
        row = {"batch": t, "layers": len(layers), "rel_diff": diff, "dtype": str(dtype)}
        if cuda:
            row["one_branch_us_per_layer"] = time_call(lambda: [one_branch(x, ly, c, s) for ly in layers],
                                                       1, args.iters) / len(layers)
            row["two_branches_us_per_layer"] = time_call(lambda: [two_branches(x, ly, c, s, side) for ly in layers],
                                                         1, args.iters) / len(layers)
            row["device"] = torch.cuda.get_device_name()
        rows.append(row)
        print(json.dumps(row), flush=True)
        if diff > (2e-2 if cuda else 1e-5):
            print(f"bench_moe_branches: the two forms differ at batch {t}: {diff:.3g}", file=sys.stderr)
            return 1
    if cuda:
        print(f"{'batch':>6} {'one branch µs':>14} {'two branches µs':>16} {'saved µs':>9}")
        for r in rows:
            one, two = r["one_branch_us_per_layer"], r["two_branches_us_per_layer"]
            print(f"{r['batch']:>6} {one:>14.1f} {two:>16.1f} {one - two:>9.1f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
