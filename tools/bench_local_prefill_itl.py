"""Decode inter-token latency while a long prompt prefills locally on the same decode worker,
through the real serving path (issue 15: ITL p99 during a local 32K prefill ≤ 3 × without it).

Usage (one H200; needs etcd on PATH and the project's packages importable):
    python tools/bench_local_prefill_itl.py --config S --budgets 0,2048,1024,512,256 \\
        --out docs/bench/local_prefill_itl_gpu.json
CPU smoke run of the script itself (tiny sizes): --smoke --device cpu

For each `--prefill-tokens-per-decode-step` budget B (0 = local chunks run whole, unpaced) it
starts `tandem up --prefill 0` (etcd, router and one decode worker on the GPU: every prompt
prefills locally there, in `--chunk-size` chunks) with seeded weights written as a checkpoint
folder, and replays one trace through `tandem bench --arrival trace`:
  --streams requests of --stream-context tokens arriving in the first milliseconds, each
  generating --stream-tokens tokens (ignore_eos), and at --long-at-s one request of
  --long-context fresh tokens generating 2.
From the bench's per-request token timestamps (one token per message: --stream-interval 1),
every gap between two consecutive tokens of a stream is one ITL sample, counted as
  "before": ending in [--warm-s, the long request's start), every stream decoding, nothing
            else prefilling;
  "during": ending while the long request waits for its first token (its local prefill).
Reported per budget: ITL p50 / p99 / max before and during, p99 during ÷ p99 before (the
issue asks ≤ 3), the long request's TTFT, the streams' output tokens/s, and the share of the
long prefill during which the streams still decoded (`during_coverage`; below 1 the "during"
figures cover only its first, cheapest chunks: raise --stream-tokens). Prompts are
Mooncake-style blocks (bench/traces.py), all distinct: nothing comes from the prefix cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.metrics import _pct  # noqa: E402
from bench.traces import MOONCAKE_BLOCK  # noqa: E402
from bench_decode import bench_config  # noqa: E402
from bench_serving_gpu import _cli, m_config, running_cluster, smoke_config, write_checkpoint  # noqa: E402


def write_trace(path: Path, args: argparse.Namespace) -> None:
    """The replayed trace: the streams (1 ms apart, so the bench does not spread them), then
    the long request; every block id distinct."""
    rows, next_block = [], 0

    def blocks(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-n_tokens // MOONCAKE_BLOCK)
        next_block += n
        return list(range(next_block - n, next_block))

    for i in range(args.streams):
        rows.append({"timestamp": i, "input_length": args.stream_context, "output_length": args.stream_tokens,
                     "hash_ids": blocks(args.stream_context)})
    rows.append({"timestamp": int(args.long_at_s * 1000), "input_length": args.long_context, "output_length": 2,
                 "hash_ids": blocks(args.long_context)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def itl_figures(doc: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """ITL samples before / during the long request's prefill (module docstring), in ms."""
    reqs = doc["requests"]
    long = next(r for r in reqs if r["prompt_len"] == args.long_context)
    streams = [r for r in reqs if r is not long]
    if long["ttft_s"] is None or any(r["error"] for r in reqs):
        return {"errors": sorted({r["error"] for r in reqs if r["error"]}), "long_ttft_ms": None}
    t_start, t_first = long["start_s"], long["start_s"] + long["ttft_s"]
    before: list[float] = []
    during: list[float] = []
    last_token = 0.0
    for r in streams:
        times = [t for t, _ in r["chunks"]]
        last_token = max(last_token, times[-1] if times else 0.0)
        for a, b in zip(times, times[1:]):
            if args.warm_s <= b < t_start:
                before.append((b - a) * 1e3)
            elif t_start <= b <= t_first:
                during.append((b - a) * 1e3)

    def dist(xs: list[float]) -> dict[str, float | None]:
        return {"n": len(xs), "p50_ms": _pct(xs, 0.5) if xs else None, "p99_ms": _pct(xs, 0.99) if xs else None,
                "max_ms": max(xs) if xs else None}

    out = {"itl_before": dist(before), "itl_during": dist(during), "long_ttft_ms": long["ttft_s"] * 1e3,
           "streams_outlast_prefill": last_token > t_first,
           # share of the long prefill during which the streams still decoded (1.0 = all of it):
           # below 1, "during" covers only the prefill's first part (its cheapest chunks)
           "during_coverage": max(0.0, min(last_token, t_first) - t_start) / max(1e-9, t_first - t_start),
           "stream_tokens_per_s": sum(r["completion_tokens"] for r in streams) / max(
               1e-9, max(r["end_s"] for r in streams) - min(r["start_s"] for r in streams))}
    b99, d99 = out["itl_before"]["p99_ms"], out["itl_during"]["p99_ms"]
    out["p99_during_over_before"] = d99 / b99 if b99 and d99 else None
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="S", choices=("S", "M"))
    p.add_argument("--budgets", default="0,2048,1024,512,256",
                   help="comma list of --prefill-tokens-per-decode-step values (0 = unpaced)")
    p.add_argument("--chunk-size", type=int, default=8192, help="the decode worker's --chunk-size")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-context", type=int, default=1024)
    p.add_argument("--stream-tokens", type=int, default=6000,
                   help="tokens per stream: enough to outlast the long prefill (see during_coverage)")
    p.add_argument("--long-context", type=int, default=32768)
    p.add_argument("--long-at-s", type=float, default=3.0, help="arrival of the long request (s)")
    p.add_argument("--warm-s", type=float, default=1.0, help="'before' samples end after this (s)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--smoke", action="store_true", help="tiny model (a CPU check of the script)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device; run on a GPU machine, "
                "or pass --device cpu (with --smoke for a quick check)")
    base = smoke_config() if args.smoke else {"S": lambda: bench_config(False), "M": m_config}[args.config]()
    longest = max(args.long_context + 8, args.stream_context + args.stream_tokens + 8)
    cfg = dataclasses.replace(base, max_position_embeddings=max(base.max_position_embeddings, longest))
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args), "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work, model_dir = Path(tmp), Path(tmp) / "model"
        doc["params"] = write_checkpoint(cfg, model_dir, device)
        trace = work / "trace.jsonl"
        write_trace(trace, args)
        for budget in (int(b) for b in args.budgets.split(",")):
            env = {**os.environ, "TANDEM_PREFILL_TOKENS_PER_DECODE_STEP": str(budget),
                   "TANDEM_CHUNK_SIZE": str(args.chunk_size), "TANDEM_MAX_RUNNING": str(args.streams + 1),
                   "TANDEM_MEM_FRACTION_STATIC": os.environ.get("TANDEM_MEM_FRACTION_STATIC", "0.4"),
                   **({"TANDEM_NUM_BLOCKS": "6000"} if device.type == "cpu" else {})}
            res = work / f"bench_{budget}.json"
            with running_cluster(model_dir, args.port, work, env, ("--prefill", "0")):
                r = subprocess.run(_cli("bench", "--router", f"127.0.0.1:{args.port}", "--dataset", f"mooncake:{trace}",
                                        "--arrival", "trace", "--out", str(res),
                                        "--temperature", "0", "--top-logprobs", "0"),
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0 or not res.exists():
                row = {"budget": budget, "rc": r.returncode, "stderr": r.stderr[-1500:]}
            else:
                row = {"budget": budget, **itl_figures(json.loads(res.read_text()), args)}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(doc, indent=1) + "\n")
    print("| budget (tokens per decode step) | ITL p99 before ms | ITL p99 during ms | during / before | "
          "ITL max during ms | 32K TTFT ms | streams decoded for |")
    for r in doc["rows"]:
        b, d = r.get("itl_before", {}), r.get("itl_during", {})
        print(f"| {r['budget'] or 'off'} | {b.get('p99_ms') or 0:.2f} | {d.get('p99_ms') or 0:.2f} | "
              f"{r.get('p99_during_over_before') or 0:.2f} | {d.get('max_ms') or 0:.1f} | {r.get('long_ttft_ms') or 0:.0f} | "
              f"{100 * (r.get('during_coverage') or 0):.0f} % of it |")
    return doc


if __name__ == "__main__":
    main()
