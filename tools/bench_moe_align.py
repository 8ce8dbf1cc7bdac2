"""The MoE align program's launch shape at a decode step's sizes: time per call per choice.

`engine/kernels/fused_moe.py`'s `align_triton` sorts a forward's (token, expert) pairs by expert
in one Triton program (counts, padded starts, each pair's row), which walks the pairs BLOCK_P at
a time with num_warps warps. At a decode step that one program is latency-bound: on one H200
(run 16) it took 19 us a layer at batch 64 of the 16B config M (512 pairs), 0.5 ms of an 11 ms
step. Every choice gives the same rows (integer sums); this script checks each against `align`
(torch) and times it in CUDA graphs of `--reps` calls (the form a decode step replays), at the
token counts whose tiles are BLOCK_M <= `ALIGN_DECODE_MAX_BLOCK_M` (where
`fused_moe.ALIGN_DECODE_TILES` applies).

Usage (CUDA only):
    python tools/bench_moe_align.py [--configs M,S,V3] [--tokens 2,8,16,32,64,128,256] [--pick] [--out FILE]

Prints one JSON row per (config, BLOCK_P, warps, T) and, per config, the fastest choice summed
over the token counts and the default's sum; --pick adds a line {"pick": {"config", "block_e",
"tiles"}} for `ALIGN_DECODE_TILES` (the fastest by that sum; a choice that failed or gave other
rows at any T is out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_moe_router import time_call  # noqa: E402
from engine.kernels.fused_moe import ALIGN_DECODE_MAX_BLOCK_M, align, align_tiles, align_triton, block_m_for  # noqa: E402

# (routed experts, top-k, shared experts) of the bench configs' MoE layers
SHAPES = {"S": (32, 4, 1), "M": (64, 6, 2), "V3": (256, 8, 1)}


def pairs_for(name: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens × (top-k + shared)] int64 flat ids: distinct random routed experts per token, then
    its shared experts' ids (E, E + 1, ...), as the routing kernel writes them."""
    e, k, shared = SHAPES[name]
    routed = torch.rand(tokens, e, device="cuda", generator=gen).argsort(1)[:, :k]
    extra = torch.arange(e, e + shared, device="cuda").expand(tokens, shared)
    return torch.cat((routed, extra), 1).reshape(-1).contiguous()


def pick(rows: list[dict], tokens: list[int]) -> tuple[tuple[int, int], float] | None:
    """(BLOCK_P, warps) with the least time summed over `tokens` among the choices that ran and
    matched `align` at every one of them, and that sum; None when none did."""
    times: dict[tuple[int, int], dict[int, float]] = {}
    bad = set()
    for r in rows:
        key = (r["block_p"], r["warps"])
        if "us" in r and r.get("same_rows"):
            times.setdefault(key, {})[r["tokens"]] = r["us"]
        else:
            bad.add(key)
    full = {k: sum(v.values()) for k, v in times.items() if k not in bad and len(v) == len(tokens)}
    if not full:
        return None
    best = min(full, key=full.get)
    return best, full[best]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="M,S", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="2,8,16,32,64,128,256",
                    help="token counts (those whose BLOCK_M exceeds the decode tiles' are skipped)")
    ap.add_argument("--block-p", default="16,32,64,128,256")
    ap.add_argument("--warps", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--iters", type=int, default=20, help="graph replays timed")
    ap.add_argument("--pick", action="store_true", help="print the fastest choice per config as {\"pick\": ...}")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON lines here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: the align program runs only there (`align` is its torch form)")
    rows: list[dict] = []
    for name in args.configs.split(","):
        e, k, shared = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        block_e = 1 << (e - 1).bit_length()
        cases = {}
        for t in (int(v) for v in args.tokens.split(",")):
            ids = pairs_for(name, t, gen)
            bm = block_m_for(ids.numel(), e + shared)
            if bm <= ALIGN_DECODE_MAX_BLOCK_M:
                cases[t] = (ids, bm, align(ids, e + shared, bm))
        grid = list(itertools.product(*([int(v) for v in s.split(",")] for s in (args.block_p, args.warps))))
        default = align_tiles(min(bm for _, bm, _ in cases.values()), block_e) if cases else None
        for tiles in ([default] if default not in grid else []) + grid:
            for t, (ids, bm, want) in cases.items():
                row = {"config": name, "tokens": t, "pairs": ids.numel(), "block_m": bm, "block_p": tiles[0],
                       "warps": tiles[1], "default": tiles == align_tiles(bm, block_e)}
                try:
                    got = align_triton(ids, e, bm, shared, tiles=tiles)
                    row["same_rows"] = all(torch.equal(a, b) for a, b in zip(got, want))
                    row["us"] = time_call(lambda ids=ids, bm=bm, tiles=tiles: align_triton(ids, e, bm, shared, tiles=tiles),
                                          args.reps, args.iters)
                except Exception as exc:  # noqa: BLE001 - a launch shape that does not fit is a result
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        mine = [r for r in rows if r["config"] == name]
        base = sum(r["us"] for r in mine if r["default"] and "us" in r)
        chosen = pick(mine, list(cases))
        if chosen is not None:
            print(f"{name}: default {base:.1f} us summed over T = {list(cases)}; fastest {chosen[0]} {chosen[1]:.1f} us")
            if args.pick:
                print(json.dumps({"pick": {"config": name, "block_e": block_e, "tiles": list(chosen[0]),
                                           "us": chosen[1], "default_us": base}}))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
