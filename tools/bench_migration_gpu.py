"""Seeded and greedy streams through the real serving path, twice and across a forced
migration between two decode workers: are the tokens the same? (The GPU decode issue's
exactness check; on a CPU in float32 tests/test_e2e_migration.py asserts equality.)

Starts a local cluster (`tandem up`'s LocalCluster: etcd, router, one prefill and two decode
workers of --model, on --device), then runs the same --streams streams three times:
  A: fault-free;   B: fault-free again;   C: decode-0 killed (SIGKILL) once every stream has
  at least --kill-after tokens, so the router migrates decode-0's streams to decode-1.
Half the streams are greedy, half sample (temperature 0.9, top-p 0.95) with a seed of their own.
It reports, for B against A and for C against A: the share of streams with identical tokens,
the share of identical tokens (position by position), and each differing stream's first
divergence; greedy and seeded separately. In bf16 on a GPU the logits of a row depend on the
batch it shares (other batch sizes, other kernels' summation order) and a migrated stream's
KV is recomputed by a prefill forward rather than by decode steps, so equality is measured, not
assumed; the sampler itself draws a row's token from (seed, step) alone (engine/sampling.py).

    python tools/bench_migration_gpu.py --device cuda --out docs/bench/migration_gpu.json
    python tools/bench_migration_gpu.py --device cpu --model tandem-tiny --streams 8 --max-tokens 16   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.client import frontend_stub  # noqa: E402
from cli.cluster import LocalCluster  # noqa: E402
from common.pb.tandem.v1 import frontend_pb2, sampling_pb2  # noqa: E402


def sampling(i: int, max_tokens: int) -> sampling_pb2.SamplingParams:
    if i % 2:
        return sampling_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.9, top_p=0.95,
                                           seed=1000 + i)
    return sampling_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


async def run_streams(cluster: LocalCluster, prompts: list[list[int]], max_tokens: int,
                      kill_after: int | None) -> list[list[int]]:
    """Every stream's tokens; with kill_after, decode-0 gets SIGKILL once each stream has that many."""
    ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
    counts = [0] * len(prompts)
    ready = asyncio.Event()

    async def one(i: int) -> list[int]:
        out: list[int] = []
        req = frontend_pb2.GenerateRequest(token_ids=prompts[i], sampling=sampling(i, max_tokens))
        async for msg in stub.Generate(req, timeout=300):
            out += msg.token_ids
            counts[i] = len(out)
            if kill_after is not None and min(counts) >= kill_after:
                ready.set()
        return out

    try:
        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        if kill_after is not None:
            await asyncio.wait_for(ready.wait(), 300)
            await asyncio.to_thread(cluster.stop_process, "decode-0", signal.SIGKILL, 60.0)
        return list(await asyncio.gather(*tasks))
    finally:
        await ch.close()


def router_migrations(cluster: LocalCluster) -> int:
    """The router's tandem_router_migrations_total (requests continued on another decode worker)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    router = next(iter(cluster.metrics_addresses().values()))  # the router comes first
    text = urllib.request.urlopen(f"http://{router}/metrics", timeout=10).read().decode()  # noqa: S310 - loopback
    return int(sum(s.value for f in text_string_to_metric_families(text) if f.name == "tandem_router_migrations"
                   for s in f.samples if s.name.endswith("_total")))


def compare(ref: list[list[int]], got: list[list[int]], which: list[int]) -> dict:
    same = [i for i in which if ref[i] == got[i]]
    tokens = sum(len(ref[i]) for i in which)
    equal = sum(a == b for i in which for a, b in zip(ref[i], got[i]))
    first = {i: next((p for p, (a, b) in enumerate(zip(ref[i], got[i])) if a != b), min(len(ref[i]), len(got[i])))
             for i in which if ref[i] != got[i]}
    return {"streams": len(which), "identical_streams": len(same), "identical_stream_share": len(same) / len(which),
            "identical_token_share": equal / tokens if tokens else 1.0,
            "first_divergence": sorted(first.values())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tandem-shakespeare", help="model name or checkpoint folder (default tandem-shakespeare)")
    ap.add_argument("--device", default="cuda", help="the workers' --device (default cuda)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    ap.add_argument("--kill-after", type=int, default=8, help="tokens every stream has before decode-0 is killed (default 8)")
    ap.add_argument("--mem-fraction-static", default="0.2", help="each worker's share of GPU memory (default 0.2)")
    ap.add_argument("--insecure", action="store_true", help="plaintext gRPC between the processes (no TLS; loopback)")
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    args = ap.parse_args(argv)
    if not 0 < args.kill_after < args.max_tokens:
        ap.error(f"--kill-after must be in (0, --max-tokens), got {args.kill_after}")
    os.environ["TANDEM_DEVICE"] = args.device
    if args.device.startswith("cuda"):
        os.environ.setdefault("TANDEM_MEM_FRACTION_STATIC", args.mem_fraction_static)
    prompts = [[(31 * i + 7 * j) % 4000 + 2 for j in range(16 + 5 * i)] for i in range(args.streams)]

    async def go() -> dict[str, list[list[int]]]:
        with tempfile.TemporaryDirectory() as logs:
            cluster = LocalCluster(model=args.model, num_decode=2, namespace="bench-migrate", log_dir=logs,
                                   ready_timeout_s=600, metrics=True, tls=not args.insecure)
            async with cluster:
                runs = {}
                for name, kill in (("A", None), ("B", None), ("C", args.kill_after)):
                    t0 = time.perf_counter()
                    runs[name] = await run_streams(cluster, prompts, args.max_tokens, kill)
                    print(json.dumps({"run": name, "seconds": round(time.perf_counter() - t0, 2),
                                      "tokens": sum(map(len, runs[name]))}), flush=True)
                runs["migrations"] = router_migrations(cluster)
                return runs

    runs = asyncio.run(go())
    greedy = [i for i in range(args.streams) if i % 2 == 0]
    seeded = [i for i in range(args.streams) if i % 2]
    res = {"args": {k: str(v) for k, v in vars(args).items()},
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "B_vs_A": {"greedy": compare(runs["A"], runs["B"], greedy), "seeded": compare(runs["A"], runs["B"], seeded)},
           "C_vs_A": {"greedy": compare(runs["A"], runs["C"], greedy), "seeded": compare(runs["A"], runs["C"], seeded)},
           "migrated_streams": runs["migrations"],
           "lengths_ok": all(len(t) == args.max_tokens for r in (runs["A"], runs["B"], runs["C"]) for t in r)}
    print(json.dumps({k: v for k, v in res.items() if k != "args"}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
