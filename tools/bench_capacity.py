"""Admission vs retraction on one decode worker (not a test): the same burst of concurrent
requests against (a) an ample KV pool, (b) a tight pool with admission at the practical
fraction (requests queue, nothing is retracted), (c) the same tight pool overcommitted
(--practical-fraction 4: everything is admitted, the decode loop retracts and re-prefills).

One decode worker runs in this process (tandem-tiny, float32, CPU; no etcd, no prefill worker:
the worker prefills locally); the requests go straight to its DecodeService over loopback gRPC.
Reports wall time, output tokens/s, the process's CPU seconds (steadier than wall time on a
busy machine), retractions, requests that queued, and whether every
configuration produced the same tokens (greedy). Each configuration runs --rounds times,
interleaved; the median wall time is reported.

Usage: python tools/bench_capacity.py [--requests 16] [--max-tokens 64] [--tight-blocks 40]
                                      [--rounds 3] [--out docs/bench/capacity.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace

import torch

from common.grpc_server import channel
from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, sampling_pb2
from decode_worker.main import run as run_decode
from engine.model_source import TINY, load_model
from worker.host import WorkerOptions


def prompts(n: int) -> list[list[int]]:
    return [[(131 * i + 17 * j) % 150000 + 1 for j in range(64 + 8 * (i % 8))] for i in range(n)]


async def burst(opts: WorkerOptions, loaded, reqs: list[list[int]], max_tokens: int) -> dict:
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(run_decode(opts, ready=lambda s, rt: ready.set_result((s, rt)), stop=stop, loaded=loaded))
    server, rt = await ready
    try:
        async with channel(f"127.0.0.1:{server.port}") as ch:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)

            async def one(tokens):
                out = []
                async for msg in stub.Generate(decode_pb2.DecodeRequest(token_ids=tokens, sampling=sampling_pb2.SamplingParams(
                        max_tokens=max_tokens, ignore_eos=True)), timeout=600):
                    out += msg.token_ids
                return out

            start, cpu = time.perf_counter(), time.process_time()
            outs = await asyncio.gather(*(one(t) for t in reqs))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(map(len, outs)), "retractions": rt.stats.retractions,
                "queued": rt.scheduler.admission.waited, "pool_blocks": rt.pool.config.num_blocks, "outputs": outs}
    finally:
        stop.set()
        await task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tight-blocks", type=int, default=40, help="KV pool of the tight configurations, in blocks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(TINY)
    base = WorkerOptions(model=TINY, num_blocks=4096, transfer_backend="nixl")
    configs = {
        "ample pool": replace(base, num_blocks=4096),
        "tight, admission 0.9": replace(base, num_blocks=args.tight_blocks, practical_fraction=0.9),
        "tight, overcommit 4 (retraction)": replace(base, num_blocks=args.tight_blocks, practical_fraction=4.0),
    }
    reqs = prompts(args.requests)
    results = {}
    # Rounds interleave the configurations, so a busy machine's load drifts over all of them alike.
    all_runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, opts in configs.items():
            all_runs[name].append(asyncio.run(burst(opts, loaded, reqs, args.max_tokens)))
    for name, runs in all_runs.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        results[name] = {"wall_s": wall, "cpu_s": cpu, "tokens_per_s": runs[0]["tokens"] / wall,
                         "retractions": [r["retractions"] for r in runs], "queued": [r["queued"] for r in runs],
                         "pool_blocks": runs[0]["pool_blocks"], "outputs": runs[0]["outputs"],
                         "same_in_every_round": all(r["outputs"] == runs[0]["outputs"] for r in runs)}
    ref = results["ample pool"]["outputs"]
    print(f"{args.requests} requests × {args.max_tokens} tokens, prompts 64..120 tokens, tandem-tiny fp32, "
          f"median of {args.rounds} rounds")
    print(f"{'configuration':36} {'blocks':>6} {'wall s':>7} {'tok/s':>7} {'vs ample':>8} {'CPU s':>6} "
          f"{'CPU vs ample':>12} {'retractions':>12} {'queued':>10} same")
    for name, r in results.items():
        r["identical_to_ample"] = r["outputs"] == ref and r["same_in_every_round"]
        print(f"{name:36} {r['pool_blocks']:>6} {r['wall_s']:>7.2f} {r['tokens_per_s']:>7.1f} "
              f"{results['ample pool']['wall_s'] / r['wall_s']:>8.2f} {r['cpu_s']:>6.1f} "
              f"{r['cpu_s'] / results['ample pool']['cpu_s']:>12.2f} {str(r['retractions']):>12} "
              f"{str(r['queued']):>10} {r['identical_to_ample']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                                                      for k, v in results.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
