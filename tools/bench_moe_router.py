"""The MoE routing kernel's tiles: time per call and agreement with the default, per tile choice.

`engine/kernels/moe_router.py` runs a MoE layer's whole routing (gate GEMM, sigmoid, bias,
group mask, top-k, weights) as one program per 16 tokens. At a decode step of a few tokens that
one program walks the gate weight ([E, hidden] bf16: 256 KB for the 16B config M) alone, and the
time is the latency of its loop over the hidden dimension (run 16 on one H200: 15 us a layer,
0.39 ms of M's 2.98 ms step at batch 1). This script times the kernel for each (BLOCK_K,
num_warps, num_stages, SPLIT) at several token counts (SPLIT s > 0: s programs per 16 tokens
compute the gate GEMM's partial sums first, one more launch), in CUDA graphs of `--reps` calls (the form a
decode step replays), and checks each choice's experts against the default tiles' (near-ties may
differ: the sum order changes with BLOCK_K and SPLIT) and its weights against the reference
(`route_with_shared_reference`). One BLOCK_K serves every token count (the kernel's default
must not depend on T: a token's scores would then depend on its batch), so pick by the sum over
the decode and prefill sizes that matter.

Usage (CUDA only):
    python tools/bench_moe_router.py [--configs M,S,V3] [--tokens 1,16,64,256,1024,8192] [--splits 0,4,16] [--out FILE] [--pick]

Prints one row per (config, tiles, T), the best tiles per config by the time summed over
--tokens and the fastest at each T; --out writes the rows as JSON lines. A tile choice that does not fit the GPU (shared
memory) gets its error in place of a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from engine.config import ModelConfig  # noqa: E402
from engine.kernels.moe_router import default_tiles, route_with_shared, route_with_shared_reference  # noqa: E402

# (hidden, routed experts, top-k, groups, top groups, shared experts): the bench configs' gates
GATES = {"S": (1024, 32, 4, 4, 2, 1), "M": (2048, 64, 6, 1, 1, 2), "V3": (7168, 256, 8, 8, 4, 1)}


def gate_config(name: str) -> tuple[ModelConfig, int]:
    """(ModelConfig with that gate's shapes and V3 routing, shared slots)."""
    hidden, e, k, groups, top_groups, shared = GATES[name]
    return dataclasses.replace(ModelConfig.tiny(), hidden_size=hidden, n_routed_experts=e, num_experts_per_tok=k,
                               n_group=groups, topk_group=top_groups), shared


def by_id(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """weights [T, slots] reordered by each token's expert ids (the kernel's slot order is its
    arg-max order, the reference's torch.topk's)."""
    return weights.gather(1, ids.argsort(1))


def time_call(fn, reps: int, iters: int) -> float:
    """Microseconds per call of fn, replayed `iters` times in a CUDA graph of `reps` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


DECODE_MAX_TOKENS = 256  # token counts up to this are a decode step's; larger ones a prefill's
PREFILL_SLACK = 1.25  # a pick may be this much slower than the fastest at a prefill's token count (there the kernel is <0.1 % of the forward)


def pick(rows: list[dict], tokens: list[int]) -> tuple[tuple[int, int, int, int], float] | None:
    """(tiles, their time summed over the decode token counts) of the tiles for `default_tiles`:
    the least decode time among the choices measured at every T whose experts agree with the
    reference as often as the default's (within 1 %) and whose time at each T above
    DECODE_MAX_TOKENS is within PREFILL_SLACK of the fastest there; the default's own tiles
    when none is (they are what runs today). None when nothing qualifies and the default was
    not measured."""
    times: dict[tuple, dict[int, float]] = {}
    agree: dict[tuple, float] = {}
    for r in rows:
        if "us" in r:
            key = (r["block_k"], r["warps"], r["stages"], r["split"])
            times.setdefault(key, {})[r["tokens"]] = r["us"]
            agree[key] = min(agree.get(key, 1.0), r["same_experts_as_reference"])
    base = next((agree[(r["block_k"], r["warps"], r["stages"], r["split"])] for r in rows
                 if r.get("default") and "us" in r), 1.0)
    full = {k: v for k, v in times.items() if len(v) == len(tokens) and agree[k] >= base - 0.01}
    big = [t for t in tokens if t > DECODE_MAX_TOKENS]
    fastest = {t: min(v[t] for v in full.values()) for t in big} if full else {}
    fit = {k: sum(u for t, u in v.items() if t <= DECODE_MAX_TOKENS) for k, v in full.items()
           if all(v[t] <= PREFILL_SLACK * fastest[t] for t in big)}
    default = next(((r["block_k"], r["warps"], r["stages"], r["split"]) for r in rows if r.get("default")), None)
    if not fit:
        if default in full:
            return default, sum(u for t, u in full[default].items() if t <= DECODE_MAX_TOKENS)
        return None
    best = min(fit, key=fit.get)
    return best, fit[best]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="M,S", help=f"comma list of {', '.join(GATES)}")
    ap.add_argument("--tokens", default="1,16,64,256,1024,8192", help="token counts per call")
    ap.add_argument("--block-k", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--splits", default="0,4,16", help="SPLIT values (0: the gate GEMM in the routing program)")
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--iters", type=int, default=20, help="graph replays timed")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON lines here")
    ap.add_argument("--pick", action="store_true",
                    help="print, per config, a JSON line {\"pick\": ...}: the tiles for the routing kernel's "
                    "default at that gate's BLOCK_E (moe_router.MEASURED_TILES): the least time over the decode "
                    f"sizes (T <= {DECODE_MAX_TOKENS}) among those within {PREFILL_SLACK:.2f} x the fastest at every "
                    "larger T")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: the routing kernel runs only there (its CPU form is the reference)")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.configs.split(","):
        c, shared = gate_config(name)
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(c.n_routed_experts, c.hidden_size, device="cuda", generator=gen) * 0.02).bfloat16()
        bias = torch.randn(c.n_routed_experts, device="cuda", generator=gen) * 0.01
        xs = {t: torch.randn(t, c.hidden_size, device="cuda", generator=gen).bfloat16() for t in tokens}
        block_e = max(16, 1 << (c.n_routed_experts - 1).bit_length())
        base = default_tiles(block_e)
        want = {t: route_with_shared(xs[t], w, bias, c, shared, tiles=base) for t in tokens}
        ref = {t: route_with_shared_reference(xs[t], w, bias, c, shared) for t in tokens}
        grid = list(itertools.product(*([int(v) for v in s.split(",")]
                                        for s in (args.block_k, args.warps, args.stages, args.splits))))
        for tiles in ([base] if base not in grid else []) + grid:  # the default always, first
            for t in tokens:
                row = {"config": name, "tokens": t, "block_k": tiles[0], "warps": tiles[1], "stages": tiles[2],
                       "split": tiles[3], "default": tiles == base}
                try:
                    ids, wts = route_with_shared(xs[t], w, bias, c, shared, tiles=tiles)
                    row["us"] = time_call(lambda t=t, tiles=tiles: route_with_shared(xs[t], w, bias, c, shared,
                                                                                    tiles=tiles),
                                          args.reps, args.iters)
                except Exception as exc:  # noqa: BLE001 - a tile choice that does not fit is a result
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    rows.append(row)
                    print(json.dumps(row))
                    break
                same = (ids.sort(1).values == want[t][0].sort(1).values).all(1)
                row["same_experts_as_default"] = same.float().mean().item()
                # weights of the tokens whose experts match the reference's (near-ties aside)
                match = (ids.sort(1).values == ref[t][0].sort(1).values).all(1)
                row["same_experts_as_reference"] = match.float().mean().item()
                row["max_weight_err"] = ((by_id(ids, wts) - by_id(*ref[t]))[match].abs().max().item()
                                         if match.any() else None)
                rows.append(row)
                print(json.dumps(row))
        ok = {}
        for r in rows:
            if r["config"] == name and "us" in r:
                ok.setdefault((r["block_k"], r["warps"], r["stages"], r["split"]), {})[r["tokens"]] = r["us"]
        full = {k: sum(v.values()) for k, v in ok.items() if len(v) == len(tokens)}
        if full:
            best = min(full, key=full.get)
            print(f"{name}: default {base} {full.get(base, float('nan')):.1f} us summed over {tokens}; "
                  f"best {best} {full[best]:.1f} us ({', '.join(f'{t}: {ok[best][t]:.1f}' for t in tokens)})")
            for t in tokens:  # the sum is the long prefill's; a decode step cares about its own T
                at_t = {k: v[t] for k, v in ok.items() if t in v}
                fastest = min(at_t, key=at_t.get)
                print(f"  T={t}: default {ok.get(base, {}).get(t, float('nan')):.1f} us, fastest {fastest} "
                      f"{at_t[fastest]:.1f} us")
            if args.pick:
                chosen = pick([r for r in rows if r["config"] == name], tokens)
                if chosen is not None:
                    print(json.dumps({"pick": {"config": name, "block_e": block_e, "tiles": list(chosen[0]),
                                               "decode_us": chosen[1], "default_decode_us":
                                               sum(ok.get(base, {}).get(t, float("nan")) for t in tokens
                                                   if t <= DECODE_MAX_TOKENS)}}))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
