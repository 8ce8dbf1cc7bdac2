"""`make demo` / `tandem demo`: start a local cluster, send the 80 MT-Bench first-turn
questions through the gRPC API with several in flight, print each answer, check every
greedy output against `reference_generate` run in this process, print a summary.

The last line is exactly:
    demo ok: <n> requests, <m> tokens, ttft_p50_ms=<x>, identical_to_reference=<k>/<n>
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import grpc

from cli.client import Completion, frontend_stub, generate
from cli.cluster import LocalCluster

QUESTIONS = Path(__file__).resolve().parent / "assets" / "mt_bench" / "question.jsonl"


def load_questions(path: Path = QUESTIONS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def send_all(address: str, prompts: list[str], concurrency: int, max_tokens: int,
                   show: bool = True, creds=None) -> list[Completion]:
    ch, stub = frontend_stub(address, creds)
    sem = asyncio.Semaphore(concurrency)
    results: list[Completion | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        async with sem:
            results[i] = await generate(stub, text=prompts[i], max_tokens=max_tokens)
        if show:
            c = results[i]
            print(f"--- [{i + 1}/{len(prompts)}] ttft {c.ttft_s * 1000:.0f} ms, {len(c.token_ids)} tokens, "
                  f"{c.finish_reason}\n{prompts[i][:100]!r}\n  → {c.text!r}", flush=True)

    try:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await ch.close()
    return [r for r in results if r is not None]


def reference_tokens(model_spec: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    import torch

    from engine.model_source import load_model
    from engine.reference import reference_generate

    torch.set_num_threads(1)  # the small model is fastest on one thread (and the workers use theirs)
    loaded = load_model(model_spec)
    tok = loaded.tokenizer()
    eos = loaded.config.eos_token_ids
    # about half a minute for the 80 questions on 2 cores: a bar on a terminal, a line every 20 elsewhere
    from tqdm import tqdm
    refs = []
    bar = tqdm(total=len(prompts), desc="reference_generate", unit="prompt", leave=False, file=sys.stderr,
               disable=None)
    for i, p in enumerate(prompts, 1):
        refs.append(reference_generate(loaded.model, tok.encode(p), max_tokens, eos))
        bar.update()
        if bar.disable and (i % 20 == 0 or i == len(prompts)):
            print(f"  reference_generate: {i}/{len(prompts)} prompts", flush=True)
    bar.close()
    return refs


async def run_demo(model: str = "tandem-shakespeare", concurrency: int = 8, max_tokens: int = 32,
                   limit: int | None = None) -> int:
    prompts = [q["turns"][0] for q in load_questions()][:limit]
    cluster = LocalCluster(model=model, namespace="demo", stop_with_launcher=True)
    print(f"starting local cluster (etcd, router, 1 prefill, 1 decode) for {model}; logs in {cluster.log_dir} ...",
          flush=True)
    t0 = time.perf_counter()
    async with cluster:
        cluster.forget_ca_key()  # as tandem up does: the logs it leaves hold no CA key
        print(f"cluster ready in {time.perf_counter() - t0:.1f} s; router at {cluster.router_address}; "
              f"sending {len(prompts)} MT-Bench questions, {concurrency} in flight, max_tokens={max_tokens}", flush=True)
        t1 = time.perf_counter()
        results = await send_all(cluster.router_address, prompts, concurrency, max_tokens,
                                 creds=cluster.client_tls)
        duration = time.perf_counter() - t1
    overhead = [line.split("router overhead: ", 1)[1] for line in (cluster.log_dir / "router.log").read_text().splitlines()
                if "router overhead: " in line]
    print("computing reference_generate in-process for every prompt ...", flush=True)
    refs = reference_tokens(model, prompts, max_tokens)
    identical = sum(1 for r, ref in zip(results, refs) if r.token_ids == ref)
    tokens = sum(len(r.token_ids) for r in results)
    ttft_p50 = statistics.median(r.ttft_s for r in results) * 1000
    print(f"\nsummary: {len(results)} requests in {duration:.1f} s ({tokens / duration:.1f} tokens/s), "
          f"TTFT p50 {ttft_p50:.1f} ms, max {max(r.ttft_s for r in results) * 1000:.1f} ms; "
          f"{overhead[-1] if overhead else 'router overhead: n/a'}")
    for i, (r, ref) in enumerate(zip(results, refs)):
        if r.token_ids != ref:
            print(f"  request {i + 1} differs from reference: got {r.token_ids}, reference {ref}")
    print(f"demo ok: {len(results)} requests, {tokens} tokens, ttft_p50_ms={ttft_p50:.1f}, "
          f"identical_to_reference={identical}/{len(results)}", flush=True)
    return 0 if identical == len(results) else 1


def main(argv: list[str] | None = None) -> int:
    import argparse

    # help in the other commands' form, "(default X)"; the demo reads no TANDEM_* variable
    p = argparse.ArgumentParser(prog="tandem demo", description=" ".join(__doc__.split("\n\n")[0].split()),
                                epilog="The demo's flags have no TANDEM_* variables.")
    p.add_argument("--model", default="tandem-shakespeare",
                   help="tandem-shakespeare (shipped, trained), tandem-tiny (seeded) or a checkpoint folder "
                        "(default %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per question (default %(default)s)")
    p.add_argument("--limit", type=int, default=0, help="send only the first N questions (default 0: all 80)")
    a = p.parse_args(argv)
    for name, least in (("limit", 0), ("concurrency", 1), ("max_tokens", 1)):
        if getattr(a, name) < least:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be {least} or more")
    # SIGTERM stops the cluster as Ctrl-C does (its processes run in sessions of their own)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(run_demo(a.model, a.concurrency, a.max_tokens, a.limit or None))
    except KeyboardInterrupt:
        return 130
    except grpc.aio.AioRpcError as exc:  # a request refused (e.g. max_tokens past the context): one line
        print(f"tandem demo: a request failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:  # start-up failures: one line, as tandem up
        print(f"tandem demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
