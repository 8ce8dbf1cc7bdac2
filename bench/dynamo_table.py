"""Our router next to NVIDIA Dynamo's on one shared arrival file: cached-token fraction per
capacity, with ratios, the pooled-capacity bound and the infinite-cache oracle.

    python -m bench.dynamo_table [--dynamo-python /tmp/dynvenv/bin/python] [--out docs/bench/routing-vs-dynamo.json]

The protocol (docs/bench/mock.md, "Against NVIDIA Dynamo"):
1. One arrival file for both simulators: the Mooncake conversation trace with each 3-second
   timestamp group spread evenly (bench/traces.py `spread_steps`), rounded to whole ms, so
   neither simulator re-spreads or bursts it.
2. The same capacity: W workers × K blocks of 512 tokens, LRU, only full blocks cached.
3. The same metric: cached prompt tokens / prompt tokens (ours `prefix_hit_rate`, Dynamo's
   `prefix_cache_reused_ratio`).
4. Ours: bench/sim.py offline replay (simulated time, deterministic) at the router's defaults
   (`--prefill-weight` derived, router/cost_weight.py), with the default and the fast timing
   model (docs/bench/mock-timing-fast.json); round-robin for the TTFT ratio.
5. Dynamo: with --dynamo-python (a venv from ../shared/peers/dynamo/setup.sh), its
   `replay.py` (default KvRouterConfig, mean of --repeats runs: it breaks ties at random) and
   `replay_tuned.py` over --dynamo-scales (its best `prefill_load_scale`), run here on the same
   file; without it, the figures recorded on 2026-12-01 with this protocol (DYNAMO_RECORDED).

The pooled bound: one LRU cache of W × K blocks that every request reaches (perfect routing, no
duplicates, in-flight blocks not pinned), engine semantics (full blocks only; a fully cached
prompt recomputes its last block). The oracle: an infinite shared cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from bench import traces
from bench.metrics import summarize
from mocker.timing import TimingModel

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO.parent / "shared" / "peers" / "dynamo"
FAST_TIMING = REPO / "docs" / "bench" / "mock-timing-fast.json"
BLOCK = 512
# (workers, blocks per worker, load): the rows of the routing comparison.
ROWS = [(8, 512, 1.0), (8, 1024, 1.0), (8, 2048, 1.0), (8, 4096, 1.0), (8, 16384, 1.0), (16, 1024, 6.0)]
# Dynamo 1.6.1 on the same spread file, 2026-12-01 (../shared/peers/dynamo/cmp-protocol.md):
# default = mean of 3 runs, tuned = best prefill_load_scale in 2..128.
DYNAMO_RECORDED = {(8, 512, 1.0): (.0736, .0904), (8, 1024, 1.0): (.1384, .1790), (8, 2048, 1.0): (.2058, .2642),
                   (8, 4096, 1.0): (.2677, .3307), (8, 16384, 1.0): (.3057, .3634), (16, 1024, 6.0): (.1622, .2454)}


def shared_arrivals(trace: Path, out: Path) -> Path:
    """Write the arrival file both simulators replay (point 1 of the protocol)."""
    with trace.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    t = [float(r["timestamp"] - rows[0]["timestamp"]) for r in rows]
    with out.open("w") as f:
        for r, x in zip(rows, traces.spread_steps(t)):
            f.write(json.dumps(dict(r, timestamp=int(round(x)))) + "\n")
    return out


def pooled_lru_hit_rate(reqs: list[traces.BenchRequest], capacity_blocks: int) -> float:
    """Cached-token fraction of one LRU prefix cache of `capacity_blocks` shared by all requests."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in reqs:
        n, keys = r.prompt_len, r.hash_ids
        full = n // BLOCK
        k = 0
        while k < min(full, (n - 1) // BLOCK) and keys[k] in lru:
            k += 1
        hit += k * BLOCK
        total += n
        for h in reversed(keys[:full]):  # leaf first, so a prefix is never older than its extension
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def _ours(job: tuple) -> dict:
    path, workers, blocks, load, mode, timing = job
    from bench.sim import SimConfig, replay

    reqs = [replace(r, arrival_s=r.arrival_s / load) for r in traces.load_mooncake(Path(path), 151646)]
    model = TimingModel.load(timing) if timing else TimingModel()
    res = replay(reqs, SimConfig(mode=mode, num_workers=workers, num_blocks=blocks, block_size=BLOCK, timing=model))
    s = summarize(reqs, res.results, res.duration_s)
    return {"workers": workers, "blocks": blocks, "load": load, "mode": mode, "timing": "fast" if timing else "default",
            "prefix_hit_rate": s["prefix_hit_rate"], "mean_ttft_ms": s["mean_ttft_ms"],
            "p99_ttft_ms": s["p99_ttft_ms"], "failed": s["failed"], "wall_s": res.wall_s}


def _dynamo(py: str, path: Path, workers: int, blocks: int, load: float, repeats: int, scales: str) -> dict:
    """Dynamo's default (mean of `repeats`) and best tuned cached-token fraction on `path`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "d.json"
        subprocess.run([py, str(PEERS / "replay.py"), "--trace", str(path), "--modes", "kv_router",
                        "--num-workers", str(workers), "--num-gpu-blocks", str(blocks), "--arrival-speedups", str(load),
                        "--repeats", str(repeats), "--out", str(out), "--md", str(Path(tmp) / "d.md")],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "DYN_LOG": "warn"})
        runs = [r["summary"]["prefix_cache_reused_ratio"] for r in json.loads(out.read_text())["runs"] if "summary" in r]
        tuned = Path(tmp) / "t.json"
        subprocess.run([py, str(PEERS / "replay_tuned.py"), "--trace", str(path), "--num-workers", str(workers),
                        "--num-gpu-blocks", str(blocks), "--arrival-speedup", str(load), "--scales", scales,
                        "--out", str(tuned)], check=True, stdout=subprocess.DEVNULL, env={**os.environ, "DYN_LOG": "warn"})
        by_scale = [(r["prefix_cache_reused_ratio"], r["prefill_load_scale"]) for r in json.loads(tuned.read_text())["runs"]]
    best = max(by_scale)
    return {"default": statistics.mean(runs), "default_runs": runs, "tuned": best[0], "tuned_scale": best[1],
            "source": "measured in this run"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dynamo_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Defaults: --dynamo-repeats 3, --dynamo-scales 4,8,16,32,64,128, "
                                        "--jobs min(4, CPUs).")
    ap.add_argument("--trace", default=str(REPO.parent / "shared/datasets/mooncake/conversation_trace.jsonl"),
                    help="a Mooncake trace (JSON lines with timestamp, input_length, output_length, hash_ids)")
    ap.add_argument("--dynamo-python", default="", help="python of a Dynamo 1.6.1 venv; empty = recorded figures")
    ap.add_argument("--dynamo-repeats", type=int, default=3)
    ap.add_argument("--dynamo-scales", default="4,8,16,32,64,128")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="replays run at once")
    ap.add_argument("--out", default="", help="JSON results; the markdown table is written beside it")
    args = ap.parse_args(argv)
    trace = Path(args.trace)
    if args.jobs < 1 or args.dynamo_repeats < 1:
        ap.error(f"--jobs and --dynamo-repeats must be >= 1, got {args.jobs} and {args.dynamo_repeats}")
    try:
        if not all(float(x) > 0 for x in args.dynamo_scales.split(",")):
            raise ValueError
    except ValueError:
        ap.error(f"--dynamo-scales must be positive numbers separated by commas, got {args.dynamo_scales!r}")
    if not args.dynamo_python and trace.name != "conversation_trace.jsonl":
        ap.error("the recorded Dynamo figures are for the Mooncake conversation trace: give --dynamo-python to "
                 f"measure Dynamo on {trace}")
    if not trace.is_file():
        ap.error(f"--trace {trace}: no such file (the Mooncake traces are in shared/datasets/mooncake/)")
    with tempfile.TemporaryDirectory() as tmp:
        path = shared_arrivals(trace, Path(tmp) / "arrivals.jsonl")
        reqs = traces.load_mooncake(path, 151646)
        oracle = traces.oracle_hit_rate(reqs)["token"]
        jobs = [(str(path), w, k, ld, "kv", "") for w, k, ld in ROWS]
        jobs += [(str(path), w, k, ld, mode, str(FAST_TIMING)) for w, k, ld in ROWS[-1:] for mode in ("kv", "round-robin")]
        jobs += [(str(path), w, k, ld, "round-robin", "") for w, k, ld in ROWS[-1:]]
        started = time.perf_counter()
        with ProcessPoolExecutor(args.jobs) as pool:
            ours = list(pool.map(_ours, jobs))
        dyn = {}
        for w, k, ld in ROWS:
            if args.dynamo_python:
                dyn[(w, k, ld)] = _dynamo(args.dynamo_python, path, w, k, ld, args.dynamo_repeats, args.dynamo_scales)
            else:
                d, t = DYNAMO_RECORDED[(w, k, ld)]
                dyn[(w, k, ld)] = {"default": d, "tuned": t, "source": "recorded 2026-12-01"}
    rows = []
    for w, k, ld in ROWS:
        o = next(r for r in ours if (r["workers"], r["blocks"], r["load"], r["mode"], r["timing"]) == (w, k, ld, "kv", "default"))
        d = dyn[(w, k, ld)]
        rows.append({"workers": w, "blocks": k, "load": ld, "ours": o["prefix_hit_rate"], "dynamo_default": d["default"],
                     "dynamo_tuned": d["tuned"], "vs_default": o["prefix_hit_rate"] / d["default"],
                     "vs_tuned": o["prefix_hit_rate"] / d["tuned"], "pooled_lru": pooled_lru_hit_rate(reqs, w * k),
                     "oracle": oracle, "dynamo": d, "ours_mean_ttft_ms": o["mean_ttft_ms"]})
    lines = ["| workers × blocks | ours, default | Dynamo default | Dynamo tuned | ours / Dynamo default | "
             "ours / Dynamo tuned | pooled LRU, same capacity | oracle (infinite) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = f"{r['workers']} × {r['blocks']:,}" + (f", load {r['load']:g}" if r["load"] != 1 else "")
        lines.append(f"| {name} | {r['ours']:.4f} | {r['dynamo_default']:.4f} | {r['dynamo_tuned']:.4f} | "
                     f"{r['vs_default']:.2f} | {r['vs_tuned']:.2f} | {r['pooled_lru']:.4f} | {r['oracle']:.4f} |")
    ttft = {(r["mode"], r["timing"]): r["mean_ttft_ms"] for r in ours if (r["workers"], r["blocks"], r["load"]) == ROWS[-1]}
    w, k, ld = ROWS[-1]
    lines.append("")
    lines.append(f"Mean TTFT at {w} × {k:,}, load {ld:g} (simulated ms): " + "; ".join(
        f"{t} timing model: kv {ttft[('kv', t)]:,.0f}, round-robin {ttft[('round-robin', t)]:,.0f}, "
        f"round-robin / kv {ttft[('round-robin', t)] / ttft[('kv', t)]:.1f}" for t in ("default", "fast")))
    table = "\n".join(lines)
    print(table)
    print(f"({len(jobs)} replays in {time.perf_counter() - started:.0f} s; Dynamo: "
          f"{'measured' if args.dynamo_python else 'recorded figures'})", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "trace": str(trace),
                                   "rows": [{**r, "dynamo": r["dynamo"]} for r in rows], "ours": ours,
                                   "cpus": os.cpu_count()}, indent=1) + "\n")
        out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
