#!/usr/bin/env python3
"""A simulated fleet of ~1,000 decode workers behind the real router, one mocker process killed
mid-run (issue 18). Not a test: a benchmark that writes one JSON file.

What runs: `tandem up --mocker W --mocker-processes P` (etcd, the router, P `tandem mocker`
processes of W / P simulated workers each, every worker its own gRPC server, port and
lease-backed etcd record; mutual TLS unless --insecure), then `tandem bench` replays the
Mooncake conversation trace (its first --requests requests, --load × its rate, --speedup ×
real time) through the router over gRPC. At --kill-at seconds into the bench, process
"mocker-1" gets SIGKILL: its W / P workers vanish without a word (no drain, no lease revoke).

What it reports (JSON at --out, a summary on stdout):
- the bench's own summary (completed, failed with their status codes, TTFT, hit rate);
- requests in flight at the kill, and for them the longest gap between two consecutive
  responses that spans the kill (how long a request on a killed worker waited before it went
  on elsewhere), against the same statistic over the run's other gaps;
- the router's decision time (block hashing + index look-up + scoring: p50 / p99 from its own
  samples, logged at shutdown) and its retries and migrations (/metrics);
- the router's memory: resident set after start-up (no blocks indexed), at the end of the run,
  and its peak; the KV index's (worker, block) entries at the end (/metrics).

Usage:
  python tools/bench_fleet.py --workers 1024 --processes 4 --requests 10000 --speedup 2 \\
      --kill-at 150 --out docs/bench/fleet_1024.json

On 2 cores, faster than 2 x real time is more than the router, 4 mockers and the client can
serve together (at 10 x, most requests waited tens of seconds; docs/bench/mock.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cli.cluster import LocalCluster  # noqa: E402

TRACE = ROOT.parent / "shared" / "datasets" / "mooncake" / "conversation_trace.jsonl"


def _kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status field in KiB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _metrics(addr: str) -> dict[str, float]:
    """Each sample name of a /metrics page with its values summed over labels."""
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _gaps(records: list[dict], kill_s: float) -> dict:
    """Gaps between consecutive responses of each request (real seconds): those spanning the
    kill, and all others."""
    spanning, others, in_flight = [], [], 0
    for r in records:
        start, end = r["start_s"], r["end_s"]
        if start <= kill_s <= end:
            in_flight += 1
        times = [start] + [t for t, _ in r.get("chunks", [])]
        worst = None
        for a, b in zip(times, times[1:]):
            if a <= kill_s <= b:
                worst = max(worst or 0.0, b - a)
            else:
                others.append(b - a)
        if worst is not None:
            spanning.append(worst)
    spanning.sort()
    others.sort()
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
    return {"in_flight_at_kill": in_flight, "gap_spanning_kill_p50_s": pick(spanning, 0.5),
            "gap_spanning_kill_p99_s": pick(spanning, 0.99), "gap_spanning_kill_max_s": spanning[-1] if spanning else None,
            "other_gaps_p99_s": pick(others, 0.99), "other_gaps_max_s": others[-1] if others else None}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1024)
    ap.add_argument("--processes", type=int, default=4, help="mocker processes (the one killed is mocker-1)")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--speedup", type=float, default=2.0, help="simulated seconds per real second")
    ap.add_argument("--load", type=float, default=4.0, help="the trace's arrival rate multiplied by this")
    ap.add_argument("--num-blocks", type=int, default=8192, help="KV blocks per simulated worker")
    ap.add_argument("--block-size", type=int, default=512, help="tokens per block (the trace's hash blocks: 512)")
    ap.add_argument("--tick", type=float, default=0.2, help="the mocker's --tick (token streaming granularity)")
    ap.add_argument("--kill-at", type=float, default=150.0, help="seconds into the bench; 0 = kill nothing")
    ap.add_argument("--load-report-interval", type=float, default=1.0, help="the router's --load-report-interval (s)")
    ap.add_argument("--health-interval", type=float, default=5.0)
    ap.add_argument("--health-timeout", type=float, default=5.0)
    ap.add_argument("--lease-ttl", type=float, default=30.0,
                    help="the simulated workers' etcd lease TTL (s): 1,024 leases renewed every TTL / 3 on 2 cores "
                         "starve etcd at the default 10 s")
    ap.add_argument("--connections", type=int, default=4, help="the bench's gRPC connections to the router")
    ap.add_argument("--insecure", action="store_true", help="plaintext gRPC (default: mutual TLS, as tandem up)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.kill_at and args.processes < 2:
        ap.error("--kill-at needs --processes >= 2 (mocker-1 is killed)")

    os.environ["TANDEM_BLOCK_SIZE"] = str(args.block_size)  # the router and the mockers must agree
    log_dir = tempfile.mkdtemp(prefix="tandem-fleet-")
    cluster = LocalCluster(
        num_mocker=args.workers, mocker_processes=args.processes, metrics=True, tls=not args.insecure,
        log_dir=log_dir, ready_timeout_s=600.0,
        mocker_args=["--num-blocks", str(args.num_blocks), "--speedup", str(args.speedup), "--tick", str(args.tick),
                     "--lease-ttl", str(args.lease_ttl)],
        router_args=["--health-interval", str(args.health_interval), "--health-timeout", str(args.health_timeout),
                     "--load-report-interval", str(args.load_report_interval)])
    t_up = time.perf_counter()
    await cluster.start()
    up_s = time.perf_counter() - t_up
    router = cluster.procs["router"]
    router_metrics = next(iter(cluster.metrics_addresses().values()))  # the router's comes first
    rss_start_kib = _kib(router.pid, "VmRSS")
    print(f"bench_fleet: {args.workers} workers in {args.processes} processes ready in {up_s:.1f} s; router RSS "
          f"{rss_start_kib / 1024:.0f} MiB; logs in {log_dir}", flush=True)

    result_path = Path(log_dir) / "bench.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "bench", "--router", cluster.router_address,
         "--dataset", f"mooncake:{args.trace}", "--num-requests", str(args.requests), "--speedup", str(args.speedup),
         "--load", str(args.load), "--connections", str(args.connections), "--out", str(result_path),
         "--temperature", "0", "--top-logprobs", "0"],  # (not a TANDEM_TEMPERATURE of the shell)
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **({"TANDEM_TLS_CA": cluster.ca.ca_path} if cluster.ca is not None else {})})
    t0 = time.perf_counter()
    killed_at = None
    killed_workers = 0
    if args.kill_at:
        def kill() -> None:
            nonlocal killed_at, killed_workers
            proc = cluster.procs["mocker-1"]
            proc.send_signal(signal.SIGKILL)
            killed_at = time.perf_counter() - t0
            killed_workers = args.workers // args.processes + (1 < args.workers % args.processes)
            print(f"bench_fleet: SIGKILL mocker-1 ({killed_workers} workers) at {killed_at:.1f} s", flush=True)
        timer = threading.Timer(args.kill_at, kill)
        timer.start()
    out_text, _ = await asyncio.to_thread(bench.communicate)
    wall = time.perf_counter() - t0
    if args.kill_at:
        timer.cancel()
    print(out_text[-3000:], flush=True)
    end = _metrics(router_metrics)
    rss_end_kib, hwm_kib = _kib(router.pid, "VmRSS"), _kib(router.pid, "VmHWM")
    await cluster.stop()
    router_log = (Path(log_dir) / "router.log").read_text(errors="replace")
    stat = r"mean_us=(\d+) p50_us=(\d+) p99_us=(\d+)"
    m = re.search(rf"decision \(hash, look up, score\) {stat} \(hashing {stat}; look up and score {stat}; cpu {stat}\)", router_log)
    data = json.loads(result_path.read_text()) if result_path.exists() else {}
    summary = data.get("summary", {})
    # The bench's request records are real seconds since its start; it starts its clock once it
    # has loaded the trace and reached the router, a little after t0: the kill time on its clock
    # is at most killed_at (gaps are wide enough that this does not matter).
    gaps = _gaps(data.get("requests", []), killed_at) if killed_at is not None else {}
    report = {
        "workers": args.workers, "mocker_processes": args.processes, "requests": args.requests,
        "speedup": args.speedup, "load": args.load, "num_blocks": args.num_blocks, "block_size": args.block_size,
        "tls": not args.insecure, "startup_s": up_s, "bench_wall_s": wall, "bench_exit_code": bench.returncode,
        "killed_process": "mocker-1" if killed_at is not None else None, "killed_at_s": killed_at,
        "killed_workers": killed_workers,
        "completed": summary.get("completed"), "failed": summary.get("failed"), "errors": summary.get("errors"),
        "mean_ttft_ms": summary.get("mean_ttft_ms"), "p99_ttft_ms": summary.get("p99_ttft_ms"),
        "block_hit_rate": summary.get("block_hit_rate"),
        "router_retries": end.get("tandem_router_retries_total"),
        "router_migrations": end.get("tandem_router_migrations_total"),
        "decision_us": {part: {"mean": int(m.group(3 * k + 1)), "p50": int(m.group(3 * k + 2)), "p99": int(m.group(3 * k + 3))}
                        for k, part in enumerate(("whole", "hashing", "look_up_and_score", "cpu"))} if m else None,
        "router_rss_mib": {"after_start": rss_start_kib / 1024, "end": rss_end_kib / 1024, "peak": hwm_kib / 1024},
        "index_entries_end": end.get("tandem_router_worker_indexed_blocks"),
        **gaps,
        "logs": log_dir,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count()},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if bench.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
