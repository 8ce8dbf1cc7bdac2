"""What mutual TLS costs, against --insecure, measured in one run (docs/benchmarks.md, "mTLS
overhead"). Not a test.

Starts two local clusters side by side (`tandem up`'s LocalCluster: etcd, router, one prefill
and one decode worker of --model each): one with mutual TLS between every process (the
default), one with --insecure (plaintext, no authentication). Then, --rounds times, alternating
which goes first, sends the demo's workload to each (`tandem demo`: the 80 MT-Bench first-turn
questions, --concurrency in flight, --max-tokens each, greedy) and reports per cluster:

- TTFT p50 and p99 over every round, and the round's wall time (the demo's summary line);
- the router process's CPU time per request (from /proc over each round, less its idle rate
  measured for 5 s before), which does not depend on how busy the other cores are;
- the router's own per-request overhead line (validation, tokenising, hashing, scoring, up to
  the decode call; router/service.py), logged at shutdown;
- whether both clusters gave the same tokens for every question (they must).

    python tools/bench_tls.py --rounds 3 --out docs/bench/tls_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.cluster import LocalCluster  # noqa: E402
from cli.demo import load_questions, send_all  # noqa: E402
from tools.bench_http import cpu_seconds, idle_cpu_rate, print_comparison, provenance, write_result  # noqa: E402

MODES = ("mtls", "insecure")


def quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


async def measure(args: argparse.Namespace) -> dict:
    prompts = [q["turns"][0] for q in load_questions()][:args.limit]
    clusters = {m: LocalCluster(model=args.model, namespace=f"bench-{m}", tls=m == "mtls") for m in MODES}
    ttft: dict[str, list[float]] = {m: [] for m in MODES}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, float] = dict.fromkeys(MODES, 0.0)
    tokens: dict[str, list[list[int]]] = {}
    try:
        for c in clusters.values():
            await c.start()
        for m, c in clusters.items():  # warm-up: first-request costs, connections, the prefix cache
            await send_all(c.router_address, prompts[:8], args.concurrency, args.max_tokens, show=False,
                           creds=c.client_tls)
        idle = {m: await idle_cpu_rate(c.procs["router"].pid) for m, c in clusters.items()}
        for r in range(args.rounds):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                c = clusters[m]
                pid = c.procs["router"].pid
                before, t0 = cpu_seconds(pid), time.perf_counter()
                results = await send_all(c.router_address, prompts, args.concurrency, args.max_tokens, show=False,
                                         creds=c.client_tls)
                wall = time.perf_counter() - t0
                cpu[m] += cpu_seconds(pid) - before - idle[m] * wall
                walls[m].append(wall)
                ttft[m] += [x.ttft_s * 1e3 for x in results]
                tokens.setdefault(m, [x.token_ids for x in results])
    finally:
        for c in clusters.values():
            await c.stop()
    out: dict = {}
    for m, c in clusters.items():
        log = (c.log_dir / "router.log").read_text().splitlines()
        overhead = [line.split("router overhead: ", 1)[1] for line in log if "router overhead: " in line]
        n = len(ttft[m])
        out[m] = {"requests": n, "ttft_p50_ms": statistics.median(ttft[m]), "ttft_p99_ms": quantile(ttft[m], 0.99),
                  "round_wall_s": statistics.median(walls[m]), "router_cpu_per_request_us": cpu[m] / n * 1e6,
                  "router_idle_cpu_per_s": idle[m], "router_overhead": overhead[-1] if overhead else ""}
    out["mtls_minus_insecure"] = {k: out["mtls"][k] - out["insecure"][k]
                                  for k in ("ttft_p50_ms", "ttft_p99_ms", "round_wall_s", "router_cpu_per_request_us")}
    out["same_tokens"] = sum(a == b for a, b in zip(tokens["mtls"], tokens["insecure"]))
    out.update(provenance(args))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tandem-shakespeare", help="served model (the demo's default)")
    p.add_argument("--rounds", type=int, default=3, help="demo workloads per cluster")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (the demo's default)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per question (the demo's default)")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions (default: all 80)")
    p.add_argument("--out", default="", help="JSON result file")
    args = p.parse_args()
    os.environ.setdefault("TANDEM_DEVICE", "cpu")
    result = asyncio.run(measure(args))
    print_comparison(result, ("insecure", "insecure"), ("mtls", "mTLS"), "mtls_minus_insecure",
                     (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
                      ("round_wall_s", "one round, wall (s)"),
                      ("router_cpu_per_request_us", "router CPU / request (µs)")))
    for m in MODES:
        print(f"{m}: {result[m]['router_overhead']}")
    print(f"same tokens on both: {result['same_tokens']}/{result['mtls']['requests'] // args.rounds}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
