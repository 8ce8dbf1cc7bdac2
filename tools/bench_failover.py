"""Failover timings (not a test): how long a killed decode worker stays in routing, and how
long a migrated stream pauses.

Starts a local cluster (etcd, router, 1 prefill, 3 decode workers, tandem-tiny), runs one long
greedy stream, kills (SIGKILL) the decode worker serving it, and measures
  (a) the stream's pause: the largest gap between two consecutive responses after the kill
      (the router migrates the stream to another decode worker);
then kills an idle decode worker (no request touches it, so only health probes can notice) and
measures
  (b) removal from routing: from that kill until ExplainRoute stops listing the dead worker
      (about --health-interval × --health-failure-threshold, plus the probe timeout).
Repeats --rounds times (a fresh cluster each) and prints each figure.

With --sigstop N instead (issue 20): one cluster (router, 1 prefill, 2 decode workers, default
health settings), N trials of: a long greedy stream; after its 5th response, SIGSTOP the decode
worker serving it (it stops answering without closing its connections); measure
  (c) stop → first migrated token: from the SIGSTOP until the client's next response (health
      probes mark the worker unhealthy, the router takes the call away and re-prefills prompt
      + generated tokens on the other worker);
then SIGCONT it and wait until the router routes to it again. Prints median and p99.

Usage: python tools/bench_failover.py [--rounds 3] [--json out.json]
       python tools/bench_failover.py --sigstop 20 [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import frontend_pb2, sampling_pb2
from engine.model_source import TINY


async def one_round() -> dict:
    cluster = LocalCluster(model=TINY, namespace="bench-failover", num_decode=3,
                           log_dir=tempfile.mkdtemp(prefix="tandem-failover-"))
    async with cluster:
        ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
        try:
            req = frontend_pb2.GenerateRequest(token_ids=list(range(1, 33)), sampling=sampling_pb2.SamplingParams(
                max_tokens=300, ignore_eos=True))
            stamps: list[float] = []
            killed_at = 0.0
            victim = ""
            async for msg in stub.Generate(req, timeout=120):
                stamps.append(time.perf_counter())
                if len(stamps) == 20:
                    # The stream's decode worker is the one with a request in flight.
                    explain = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
                    busy = max((c for c in explain.candidates if c.role == "decode"), key=lambda c: c.load)
                    victim = busy.instance_id
                    name = next(n for n in cluster.procs if n.startswith("decode")
                                and victim in (cluster.log_dir / f"{n}.log").read_text())
                    killed_at = time.perf_counter()
                    cluster.stop_process(name, signal.SIGKILL)
            pause = max(b - a for a, b in zip(stamps, stamps[1:]) if b > killed_at)
            explain = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
            idle = next(c.instance_id for c in explain.candidates if c.role == "decode" and c.instance_id != victim)
            name = next(n for n in cluster.procs if n.startswith("decode") and cluster.procs[n].poll() is None
                        and idle in (cluster.log_dir / f"{n}.log").read_text())
            killed_at = time.perf_counter()
            cluster.stop_process(name, signal.SIGKILL)
            while True:
                explain = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
                if idle not in {c.instance_id for c in explain.candidates}:
                    removed = time.perf_counter() - killed_at
                    break
                await asyncio.sleep(0.02)
            return {"tokens": len(stamps), "pause_s": pause, "removed_from_routing_s": removed}
        finally:
            await ch.close()


async def sigstop_trials(n: int) -> list[float]:
    cluster = LocalCluster(model=TINY, namespace="bench-stuck", num_decode=2,
                           log_dir=tempfile.mkdtemp(prefix="tandem-stuck-"))
    async with cluster:
        ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
        names = {}
        for name in ("decode-0", "decode-1"):
            log = (cluster.log_dir / f"{name}.log").read_text()
            names[next(i for i in cluster.instances if i in log)] = name
        explain_req = frontend_pb2.GenerateRequest(token_ids=[1])
        out = []
        try:
            for trial in range(n):
                req = frontend_pb2.GenerateRequest(token_ids=[(7 * trial + j) % 1000 + 1 for j in range(32)],
                                                   sampling=sampling_pb2.SamplingParams(max_tokens=64, ignore_eos=True))
                count, stopped_at, first_after, pid = 0, 0.0, 0.0, 0
                async for _ in stub.Generate(req, timeout=120):
                    count += 1
                    if stopped_at and not first_after:
                        first_after = time.perf_counter()
                    if count == 5:
                        # the worker holding this stream: the router's own in-flight count (one
                        # request in flight at a time), not ExplainRoute's load, which can tie
                        status = await stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=5)
                        (busy,) = [w for w in status.workers if w.role == "decode" and w.in_flight_requests]
                        pid = cluster.procs[names[busy.instance_id]].pid
                        os.kill(pid, signal.SIGSTOP)
                        stopped_at = time.perf_counter()
                os.kill(pid, signal.SIGCONT)
                out.append(first_after - stopped_at)
                print(f"trial {trial}: stop -> first migrated token {out[-1] * 1000:.0f} ms", flush=True)
                while True:  # back in routing before the next trial
                    explain = await stub.ExplainRoute(explain_req, timeout=5)
                    if sum(c.role == "decode" for c in explain.candidates) == 2:
                        break
                    await asyncio.sleep(0.1)
        finally:
            await ch.close()
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sigstop", type=int, default=0, help="trials of SIGSTOP of the serving decode worker")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.sigstop:
        xs = asyncio.run(sigstop_trials(a.sigstop))
        ys = sorted(xs)
        p99 = ys[min(len(ys) - 1, int(0.99 * len(ys)))]
        print(f"stop -> first migrated token over {len(xs)} trials: median {statistics.median(xs) * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms, max {ys[-1] * 1000:.0f} ms")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"stop_to_first_migrated_token_s": xs}, f, indent=1)
        return
    rows = [asyncio.run(one_round()) for _ in range(a.rounds)]
    for r in rows:
        print(f"stream of {r['tokens']} responses: migration pause {r['pause_s'] * 1000:.0f} ms; "
              f"dead worker out of routing after {r['removed_from_routing_s']:.2f} s")
    print(f"median: pause {statistics.median(r['pause_s'] for r in rows) * 1000:.0f} ms, removal "
          f"{statistics.median(r['removed_from_routing_s'] for r in rows):.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
