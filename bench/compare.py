"""Compare router modes on one trace slice: a table per mode plus the oracle, and plots.

    python -m bench.compare --dataset mooncake:PATH --workers 16 --num-blocks 2048 --load 6 \\
        --modes kv,approx,round-robin,random,least-loaded --out docs/bench/mock-conv-16.json
    python -m bench.compare ... --live --speedup 10     # through gRPC: tandem up --mocker N per mode

Offline (default): bench/sim.py replays the slice in simulated time through the router's own
placement code and MockEngines — exact and deterministic. --live: for each mode a fresh local
cluster (etcd, `tandem router --router-mode MODE`, one `tandem mocker` process with N workers)
is started and `tandem bench`'s load generator replays the slice over the gRPC API in real
time at --speedup. The oracle row is the infinite shared cache's hit rate, and its mean TTFT
the lowest any placement can reach under the timing model (`traces.ttft_lower_bounds`: each
prompt's part outside that cache prefilled at once on an idle worker, nothing queued; shown
where --block-size is a multiple of the trace's 512-token blocks). Each mode's line also gives
that bound over the requests it completed (`ttft_bound_ms`), so the two means cover the same
requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench import traces
from bench.metrics import summarize
from bench.plots import plot_runs
from mocker.timing import TimingModel
from router.policy import MODES

COLUMNS = [("mode", "{}"), ("block_hit_rate", "{:.4f}"), ("prefix_hit_rate", "{:.4f}"), ("mean_ttft_ms", "{:,.0f}"),
           ("median_ttft_ms", "{:,.0f}"), ("p99_ttft_ms", "{:,.0f}"), ("mean_tpot_ms", "{:.1f}"),
           ("output_throughput", "{:,.0f}"), ("request_throughput", "{:.2f}"), ("completed", "{}"), ("failed", "{}"),
           ("wall_s", "{:.1f}")]


def markdown(rows: list[dict]) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" if c == "mode" else "---:" for c, _ in COLUMNS) + "|"
    body = ["| " + " | ".join(fmt.format(r[c]) if c in r else "" for c, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def _timing(args) -> TimingModel:
    return TimingModel.load(args.timing) if args.timing else TimingModel()


def _offline(reqs, mode: str, args) -> tuple[list, dict, float]:
    from bench.sim import SimConfig, replay

    res = replay(reqs, SimConfig(mode=mode, num_workers=args.workers, num_blocks=args.num_blocks,
                                 block_size=args.block_size, chunk_size=args.chunk_size,
                                 prefill_weight=args.prefill_weight, kv_recent_s=args.kv_recent, seed=args.seed,
                                 replicas=args.replicas, load_report_s=args.load_report,
                                 timing=_timing(args)))
    summary = summarize(reqs, res.results, res.duration_s)
    summary["max_requests_per_worker"] = max(res.per_worker_requests.values())
    summary["decision_us"] = _decision_us(res.decision_s)
    return res.results, summary, res.wall_s


def _decision_us(samples: list[tuple[float, float]]) -> dict:
    """p50 / p99 in µs (real time) of the whole decision, of hashing the prompt, and of the rest
    (the KV index look-up and scoring every candidate)."""
    def q(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"p50": xs[len(xs) // 2] * 1e6, "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e6} if xs else {}
    return {"whole": q([w for w, _ in samples]), "hashing": q([h for _, h in samples]),
            "look_up_and_score": q([w - h for w, h in samples])}


def _live(reqs, mode: str, args) -> tuple[list, dict, float]:
    from bench.client import run_load
    from cli.cluster import LocalCluster

    os.environ["TANDEM_BLOCK_SIZE"] = str(args.block_size)  # router and mocker must agree

    async def go():
        # Health probes get 5 s: a CPU-starved machine must not read as dead workers.
        cluster = LocalCluster(num_mocker=args.workers, router_args=[
            "--router-mode", mode, "--prefill-weight", str(args.prefill_weight), "--health-interval", "5",
            "--health-timeout", "5", "--kv-recent", str(args.kv_recent)],
            mocker_args=[*(["--timing", args.timing] if args.timing else []), "--num-blocks", str(args.num_blocks),
                         "--chunk-size", str(args.chunk_size),
                         "--speedup", str(args.speedup), "--tick", str(args.tick)], ready_timeout_s=300)
        await cluster.start()
        try:
            return await run_load(cluster.router_address, reqs, args.speedup, creds=cluster.client_tls)
        finally:
            await cluster.stop()

    started = time.perf_counter()
    results, wall = asyncio.run(go())
    summary = summarize(reqs, results, wall, args.speedup)
    return results, summary, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="mooncake", help="mooncake[:PATH] (default: the shipped slice)")
    ap.add_argument("--num-requests", type=int, default=0, help="0 = the whole file")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--load", type=float, default=1.0, help="arrival rate multiplier")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV capacity per worker, in blocks")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=8192)
    ap.add_argument("--prefill-weight", type=float, default=0.0,
                    help="kv/approx: the router's --prefill-weight (0 = derived from the timing model and the mean "
                         "output length, the router's default)")
    ap.add_argument("--timing", default="", help="timing model JSON (mocker/timing.py fields); default: the defaults")
    ap.add_argument("--kv-recent", type=float, default=0.0, help="kv mode: the router's --kv-recent (seconds)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="offline kv mode: routers sharing the traffic, each counting only its own load")
    ap.add_argument("--load-report", type=float, default=0.1,
                    help="offline: seconds between the workers' load reports (the router's default --load-reports; "
                         "< 0 = none: each router counts only its own placements)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--live", action="store_true", help="through gRPC against tandem up --mocker N (real time)")
    ap.add_argument("--speedup", type=float, default=10.0, help="--live: the mocker's speedup")
    ap.add_argument("--tick", type=float, default=0.2, help="--live: the mocker's --tick (token streaming granularity)")
    ap.add_argument("--out", default="", help="JSON results; a markdown table and plots are written beside it")
    ap.add_argument("--plots", default="", help="plot path prefix (default: --out without .json)")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1 and (args.live or set(args.modes.split(",")) != {"kv"} or args.kv_recent > 0):
        ap.error("--replicas > 1 runs offline in kv mode only: give --modes kv, without --live or --kv-recent")
    name, _, path = args.dataset.partition(":")
    if name != "mooncake":
        ap.error("--dataset must be mooncake[:PATH]")
    reqs = traces.load_mooncake(Path(path) if path else traces.DEFAULT_TRACE, 151646, args.num_requests or None,
                                args.skip)
    reqs = [replace(r, arrival_s=r.arrival_s / args.load) for r in reqs]
    oracle = traces.oracle_hit_rate(reqs)
    bounds = (traces.ttft_lower_bounds(reqs, _timing(args)) if args.block_size % traces.MOONCAKE_BLOCK == 0
              else {})  # smaller blocks cache parts of a trace block: no bound computed
    rows = [{"mode": "oracle (infinite shared cache)", "block_hit_rate": oracle["block"],
             "prefix_hit_rate": oracle["token"],
             **({"mean_ttft_ms": 1e3 * sum(bounds.values()) / len(bounds)} if bounds else {})}]
    runs = []
    print(f"{len(reqs)} requests, {args.workers} workers x {args.num_blocks} blocks of {args.block_size} tokens, "
          f"load {args.load}, {'live' if args.live else 'offline'}; oracle {oracle}", file=sys.stderr, flush=True)
    print("\n".join(markdown([]).splitlines()[:2]), file=sys.stderr, flush=True)  # the header, then a row per mode
    for mode in args.modes.split(","):
        load_before = os.getloadavg()
        results, summary, wall = (_live if args.live else _offline)(reqs, mode, args)
        label = f"{mode} --kv-recent {args.kv_recent:g}" if mode == "kv" and args.kv_recent > 0 else mode
        if args.replicas > 1:
            label += f", {args.replicas} replicas"
        if args.prefill_weight > 0 and mode in ("kv", "approx"):
            label += f" --prefill-weight {args.prefill_weight:g}"
        done = [r.index for r in results if r.ok and r.ttft_s is not None]
        bound = {"ttft_bound_ms": 1e3 * sum(bounds[i] for i in done) / len(done)} if bounds and done else {}
        rows.append({"mode": label, **summary, **bound, "wall_s": wall, "loadavg_before": load_before})
        runs.append((label, reqs, results, args.speedup if args.live else 1.0))
        print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        if bound:
            print(f"  TTFT bound over the {len(done)} requests this mode completed (the lowest any placement "
                  f"could reach): {bound['ttft_bound_ms']:,.0f} ms; this mode's mean TTFT / bound "
                  f"{summary.get('mean_ttft_ms', 0) / bound['ttft_bound_ms']:.2f}",
                  file=sys.stderr, flush=True)
        if "decision_us" in summary:
            print("  decision (real time, µs): " + "; ".join(
                f"{part} p50 {d['p50']:.0f} p99 {d['p99']:.0f}" for part, d in summary["decision_us"].items() if d),
                file=sys.stderr, flush=True)
    table = markdown(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "oracle": oracle, "timing": asdict(_timing(args)),
                                   "rows": rows, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "cpus": os.cpu_count()}, indent=1) + "\n")
        out.with_suffix(".md").write_text(table + "\n")
        plots = plot_runs(runs, Path(args.plots) if args.plots else out.with_suffix(""),
                          f"({args.workers} workers, load {args.load})")
        print(f"wrote {out}, {out.with_suffix('.md')}, {', '.join(map(str, plots))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
