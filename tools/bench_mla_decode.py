"""Sweep the paged MLA decode kernel's stage-1 launch shape on a GPU (engine/kernels/mla_decode.py).

Usage (CUDA only):
    python tools/bench_mla_decode.py [--heads 16] [--batches 1,8,64,256] [--contexts 1024,8192]
                                     [--dtype bf16|fp8] [--out FILE]
    python tools/bench_mla_decode.py --graph [--batches 1,2,4] [--contexts 1024] [--out FILE]
      (each launch shape and split count timed in a CUDA graph, as the decode step runs it: at
      batch 1 config M's kernel took 8.2 µs a layer in the step on an H100, run 24, where
      do_bench's eager timing, about 26 µs, is mostly launch overhead)

For every (batch, context) it times `mla_decode` (both stages, `triton.testing.do_bench`
median, µs) at every `Stage1Config` of the grid (block_n × num_warps × num_stages × waves) and
at the current default, on a pool of block size 16 with scattered block tables and every
sequence `context` tokens long (configs S and M of tools/bench_serving_gpu.py both have 16
heads, kv_lora_rank 512, rope 64). Bytes counted: each sequence's cached latents read once
(context × (R + P) × element size) plus q and the output; TB/s = bytes / time. Every config's
output is checked against `mla_decode_reference` at batch 8 and 1K context (relative error,
must be < 1e-2) before it is timed. Prints one JSON line per (shape, config) and a table of the
default against the best per shape; --out writes the JSON lines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graph_timing import JsonRows, capture, replay_us  # noqa: E402
from engine.kernels.mla_decode import (DEFAULT_STAGE1, FP8, Stage1Config, mla_decode,  # noqa: E402
                                       mla_decode_reference)

R, P, BS = 512, 64, 16


def make_inputs(batch: int, context: int, heads: int, dtype: torch.dtype, seed: int):
    """(q, pool, tables, lens): a 3-layer pool of block size 16 with each sequence's blocks scattered."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-context // BS)
    nb = 1 + batch * width
    kv = torch.randn(nb, 3, BS, R + P, device="cuda", generator=g)
    kv = kv.to(FP8) if dtype == FP8 else kv.to(dtype)
    tables = (torch.randperm(nb - 1, device="cuda", generator=g) + 1).view(batch, width).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, R + P, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kv, tables, lens


GRAPH_CALLS = 64
GRAPH_SPLITS = (None, 4, 8, 16, 32)  # None: num_splits' choice (the served path's)


def graph_inputs(batch: int, context: int, heads: int, dtype: torch.dtype):
    """(q, kv, tables, lens) with a pool of GRAPH_CALLS layers (each sequence's latents of every
    layer: past the L2 cache once they pass 50 MB, as in a decode step, where each layer reads
    its own)."""
    g = torch.Generator(device="cuda").manual_seed(batch + context)
    width = -(-context // BS)
    nb = 1 + batch * width
    kv = torch.randn(nb, GRAPH_CALLS, BS, R + P, device="cuda", generator=g)
    kv = kv.to(FP8) if dtype == FP8 else kv.to(dtype)
    tables = (torch.randperm(nb - 1, device="cuda", generator=g) + 1).view(batch, width).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, R + P, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kv, tables, lens


def graph_us(inputs, scale: float, cfg: Stage1Config, splits: int | None) -> float:
    """µs a call of `mla_decode` (both stages), GRAPH_CALLS calls in one CUDA graph, call i on
    layer i of `graph_inputs`' pool; median of 10 replays."""
    q, kv, tables, lens = inputs

    def calls():
        for layer in range(GRAPH_CALLS):
            mla_decode(q, kv, layer, tables, lens, R, scale, 0.5, splits=splits, config=cfg)
    return replay_us(capture(calls), GRAPH_CALLS, replays=10)


def graph_sweep(ok: list[Stage1Config], batches: list[int], contexts: list[int], heads: int,
                dtype: torch.dtype, scale: float, out: Path | None) -> None:
    """--graph: every checked config at every split count, per (batch, context); a table of the
    default (DEFAULT_STAGE1, num_splits) against the best."""
    lines, table = JsonRows(), []
    for batch in batches:
        for context in contexts:
            timed = []
            inputs = graph_inputs(batch, context, heads, dtype)
            for cfg in ok:
                for splits in GRAPH_SPLITS:
                    if splits and (context // splits < cfg.block_n // 2 or cfg.waves != 2):
                        continue  # most of a split's one block of rows masked; waves only pick splits
                    us = graph_us(inputs, scale, cfg, splits)
                    row = {"batch": batch, "context": context, "heads": heads, "graph": True, "config": cfg.__dict__,
                           "splits": splits, "us": round(us, 3), "default": cfg == DEFAULT_STAGE1 and splits is None}
                    timed.append(lines.add(row))
            del inputs
            torch.cuda.empty_cache()
            table.append((batch, context, next(r for r in timed if r["default"]), min(timed, key=lambda r: r["us"])))
    lines.write(out)
    print("| batch | context | default µs a call in a graph | best µs | best (block_n, warps, stages, splits) |")
    for batch, context, d, b in table:
        c = b["config"]
        print(f"| {batch} | {context} | {d['us']:.2f} | {b['us']:.2f} | {c['block_n']}, {c['num_warps']}, "
              f"{c['num_stages']}, {b['splits']} |")


def grid() -> list[Stage1Config]:
    return [Stage1Config(n, w, s, v) for n, w, s, v in
            itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4), (1, 2, 4))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--graph", action="store_true",
                    help="time each (config, splits) as 64 calls in one CUDA graph, each call on another "
                         "layer of a pool larger than L2 (as a decode step's layers follow each other), "
                         "splits 4, 8, 16, 32 and the default; for small batches (default --batches 1,2,4)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import triton.testing
    dtype = FP8 if args.dtype == "fp8" else torch.bfloat16
    elem = 1 if dtype == FP8 else 2
    scale = (R + P) ** -0.5

    q, kv, tables, lens = make_inputs(8, 1024, args.heads, dtype, seed=0)
    want = mla_decode_reference(q, kv, 1, tables, lens, R, scale, 0.5)
    ok: list[Stage1Config] = []
    for cfg in dict.fromkeys([DEFAULT_STAGE1, *grid()]):
        try:
            got = mla_decode(q, kv, 1, tables, lens, R, scale, 0.5, config=cfg).float()
        except Exception as exc:  # noqa: BLE001 - e.g. too much shared memory: reported, skipped
            print(json.dumps({"config": cfg.__dict__, "error": f"{type(exc).__name__}: {exc}"[:160]}), flush=True)
            continue
        err = float((got - want).norm() / want.norm())
        if not (err < 1e-2):
            print(json.dumps({"config": cfg.__dict__, "rel_err": err, "error": "wrong result"}), flush=True)
            continue
        ok.append(cfg)
    del q, kv, tables, lens, want

    if args.graph:
        batches = "1,2,4" if args.batches == ap.get_default("batches") else args.batches
        return graph_sweep(ok, [int(x) for x in batches.split(",")], [int(x) for x in args.contexts.split(",")],
                           args.heads, dtype, scale, args.out)
    lines, table = JsonRows(), []
    for batch in (int(x) for x in args.batches.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            q, kv, tables, lens = make_inputs(batch, context, args.heads, dtype, seed=batch + context)
            nbytes = batch * (context * (R + P) * elem + args.heads * (2 * R + P) * 2)
            timed = []
            for cfg in ok:
                us = 1e3 * triton.testing.do_bench(
                    lambda: mla_decode(q, kv, 1, tables, lens, R, scale, 0.5, config=cfg),  # noqa: B023
                    warmup=10, rep=40, return_mode="median")
                row = {"batch": batch, "context": context, "heads": args.heads, "dtype": args.dtype,
                       "config": cfg.__dict__, "us": us, "tb_s": nbytes / us / 1e6,
                       "default": cfg == DEFAULT_STAGE1}
                timed.append(lines.add(row))
            default = next(r for r in timed if r["default"])
            best = min(timed, key=lambda r: r["us"])
            table.append((batch, context, default, best))
            del q, kv, tables, lens
            torch.cuda.empty_cache()
    lines.write(args.out)
    print("| batch | context | default µs (TB/s) | best µs (TB/s) | best config (block_n, warps, stages, waves) |")
    for batch, context, d, b in table:
        c = b["config"]
        print(f"| {batch} | {context} | {d['us']:.1f} ({d['tb_s']:.2f}) | {b['us']:.1f} ({b['tb_s']:.2f}) | "
              f"{c['block_n']}, {c['num_warps']}, {c['num_stages']}, {c['waves']} |")


if __name__ == "__main__":
    main()
