"""Sweep the paged MLA decode kernel's stage-1 launch shape on a GPU (engine/kernels/mla_decode.py).

Usage (CUDA only):
    python tools/bench_mla_decode.py [--heads 16] [--batches 1,8,64,256] [--contexts 1024,8192]
                                     [--dtype bf16|fp8] [--out FILE]

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

    lines, table = [], []
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
                timed.append(row)
                lines.append(row)
                print(json.dumps(row), flush=True)
            default = next(r for r in timed if r["default"])
            best = min(timed, key=lambda r: r["us"])
            table.append((batch, context, default, best))
            del q, kv, tables, lens
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    print("| batch | context | default µs (TB/s) | best µs (TB/s) | best config (block_n, warps, stages, waves) |")
    for batch, context, d, b in table:
        c = b["config"]
        print(f"| {batch} | {context} | {d['us']:.1f} ({d['tb_s']:.2f}) | {b['us']:.1f} ({b['tb_s']:.2f}) | "
              f"{c['block_n']}, {c['num_warps']}, {c['num_stages']}, {c['waves']} |")


if __name__ == "__main__":
    main()
