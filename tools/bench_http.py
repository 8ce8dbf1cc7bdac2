"""The HTTP API's cost against gRPC, measured in one run (docs/benchmarks.md, "HTTP API overhead").

Starts a local cluster (`tandem up`'s LocalCluster: etcd, router with --http-port, one prefill
and one decode worker of --model), then sends the same request — one fixed prompt, so every
request after the first is a full prefix-cache hit and all cost the same — one at a time, in
alternating blocks of --block requests over gRPC (`tandem bench`'s client) and over
POST /v1/completions (`tandem bench --backend openai`'s client). It reports per backend:

- TTFT p50 and request duration p50 at the client, for --short-token requests (a block's first
  request, which opens the HTTP connection, left out) (the HTTP path's
  added latency per request is the difference of the TTFT medians);
- the HTTP layer's own wall time in the router (router/http_api.py HttpTimings, from its log):
  arrival to Generate, and each response from Generate to its event on the socket;
- the router process's CPU time per --short request, and per streamed token: the slope of CPU
  per request between --short and --long requests (from /proc over each block), which does
  not depend on how busy the machine's other cores are; the router's idle CPU rate (measured
  for 5 s before) times each block's wall time is subtracted.

    python tools/bench_http.py --requests 100 --out /tmp/http_overhead.json
    python tools/bench_http.py --mocker --requests 400 --out /tmp/http_overhead_mocker.json

With --mocker the workers are simulated (`tandem mocker`: real gRPC, real router, simulated
engine timing), so the two cores of a small machine are the router's and the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import RequestResult, run_load  # noqa: E402
from bench.traces import BenchRequest  # noqa: E402
from cli.cluster import LocalCluster  # noqa: E402

BACKENDS = ("grpc", "openai")


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process `pid` so far, in seconds (schedstat: nanoseconds,
    where /proc/PID/stat counts 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def idle_cpu_rate(pid: int, seconds: float = 5.0) -> float:
    """The router's CPU seconds per second with no request (health probes, KV event streams,
    etcd keep-alives, timers): subtracted from each block's CPU over the block's wall time."""
    before, t = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.perf_counter() - t)


async def run_blocks(cluster: LocalCluster, backend: str, req: BenchRequest, n: int,
                     idle: float = 0.0) -> tuple[list[RequestResult], float]:
    """n requests one at a time on `backend`; (results, router CPU seconds they took beyond idle)."""
    http_url = f"http://{cluster.http_address}" if backend == "openai" else ""
    before = cpu_seconds(cluster.procs["router"].pid)
    results, wall = await run_load(cluster.router_address, [req] * n, concurrency=1, progress=False,
                                   http_url=http_url, model=cluster.model, creds=cluster.client_tls)
    cpu = cpu_seconds(cluster.procs["router"].pid) - before - idle * wall
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{backend}: {len(bad)} requests failed, e.g. {bad[0]}")
    return results, cpu


async def measure(args: argparse.Namespace) -> dict:
    if args.mocker:  # one process of simulated workers (1 prefill, 1 decode): almost no CPU of their own
        cluster = LocalCluster(num_prefill=0, num_decode=0, num_mocker=1, router_port=0, http_port=0,
                               mocker_args=["--num-prefill", "1", "--num-blocks", "1024", "--speedup", str(args.speedup)])
    else:
        cluster = LocalCluster(model=args.model, num_prefill=1, num_decode=1, router_port=0, http_port=0,
                               worker_args=["--num-blocks", "1024"])
    await cluster.start()
    prompt = tuple((1000 + 7 * i) % 4000 for i in range(args.prompt_len))
    lengths = (args.short, args.long)
    results: dict = {(b, n): [] for b in BACKENDS for n in lengths}
    cpu: dict = {(b, n): 0.0 for b in BACKENDS for n in lengths}
    warm: dict = {(b, n): [] for b in BACKENDS for n in lengths}
    try:
        for backend in BACKENDS:  # warm-up: the prompt's KV into the prefix cache, first-request costs
            await run_blocks(cluster, backend, BenchRequest(0, 0.0, args.short, prompt), 4)
        idle = await idle_cpu_rate(cluster.procs["router"].pid)
        for _ in range(args.requests // args.block):
            for n in lengths:
                for backend in BACKENDS:
                    rs, c = await run_blocks(cluster, backend, BenchRequest(0, 0.0, n, prompt), args.block, idle)
                    # A block's first request opens its connection (HTTP) or stream (gRPC): latency
                    # statistics leave it out; CPU counts every request.
                    results[backend, n] += rs
                    warm[backend, n] += rs[1:]
                    cpu[backend, n] += c
    finally:
        await cluster.stop()
    # The router logs router/http_api.py HttpTimings at shutdown: the HTTP layer's own wall time.
    http_layer = [line.split("http layer: ", 1)[1] for line in (cluster.log_dir / "router.log").read_text().splitlines()
                  if "http layer: " in line]
    out: dict = {"http_layer_in_router": http_layer[-1] if http_layer else ""}
    for backend in BACKENDS:
        per_req = {n: cpu[backend, n] / len(results[backend, n]) for n in lengths}
        short = warm[backend, args.short]
        out[backend] = {
            "requests": sum(len(results[backend, n]) for n in lengths),
            "ttft_p50_ms": p50([r.ttft_s * 1e3 for r in short]),
            "duration_p50_ms": p50([(r.end_s - r.start_s) * 1e3 for r in short]),
            "router_cpu_per_request_us": per_req[args.short] * 1e6,
            # the marginal cost of one more streamed token: the slope between the two lengths
            "router_cpu_per_token_us": (per_req[args.long] - per_req[args.short]) / (args.long - args.short) * 1e6,
        }
    out["http_minus_grpc"] = {k: out["openai"][k] - out["grpc"][k] for k in out["grpc"] if k != "requests"}
    out["router_idle_cpu_per_s"] = idle
    from router.http_api import HTTP_PARSER
    out["http_parser"] = HTTP_PARSER
    out.update(provenance(args))
    return out


def print_comparison(result: dict, a: tuple[str, str], b: tuple[str, str], diff: str,
                     rows: tuple[tuple[str, str], ...]) -> None:
    """A table of result[a[0]][key] and result[b[0]][key] with result[diff][key] (b − a), one
    row per (key, label); a[1] and b[1] head the columns."""
    print(f"{'':<30}{a[1]:>12}{b[1]:>12}{b[1] + ' − ' + a[1]:>18}")
    for key, label in rows:
        print(f"{label:<30}{result[a[0]][key]:>12.2f}{result[b[0]][key]:>12.2f}{result[diff][key]:>+18.2f}")


def write_result(path: str, result: dict) -> None:
    """The result as JSON at `path` ("" = nowhere), saying so on stderr."""
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def provenance(args: argparse.Namespace) -> dict:
    """What a result file records besides its figures: the options, the machine, the date (UTC)."""
    return {"options": vars(args),
            "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tandem-tiny", help="served model (default tandem-tiny)")
    p.add_argument("--mocker", action="store_true",
                   help="simulated workers (tandem mocker, model tandem-mock) instead of --model's: on a machine "
                        "of few cores the real workers' CPU blurs the router's figures")
    p.add_argument("--speedup", type=float, default=20.0, help="with --mocker: simulated seconds per real second")
    p.add_argument("--requests", type=int, default=100, help="requests per backend and output length")
    p.add_argument("--block", type=int, default=20, help="requests per block (backends and lengths alternate)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--short", type=int, default=8, help="generated tokens of the short requests (TTFT, per request)")
    p.add_argument("--long", type=int, default=64, help="generated tokens of the long ones (per-token slope)")
    p.add_argument("--out", default="", help="JSON result file")
    args = p.parse_args()
    if args.requests < args.block or args.block < 2 or not 1 <= args.short < args.long:
        p.error("--requests must be >= --block >= 2, and 1 <= --short < --long")
    os.environ.setdefault("TANDEM_DEVICE", "cpu")
    result = asyncio.run(measure(args))
    print_comparison(result, ("grpc", "gRPC"), ("openai", "HTTP"), "http_minus_grpc",
                     (("ttft_p50_ms", "TTFT p50 (ms)"), ("duration_p50_ms", "request p50 (ms)"),
                      ("router_cpu_per_request_us", "router CPU / request (µs)"),
                      ("router_cpu_per_token_us", "router CPU / token (µs)")))
    print(f"in the router: {result['http_layer_in_router']}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
