"""Prefill through the real serving path on one GPU, next to the same engine in-process, in
one run (issue 15's measurement: batched chunked prefill, TTFT near the compute limit).

Usage (one H200; needs etcd on PATH and the project's packages importable):
    python tools/bench_prefill_serving_gpu.py --configs S,M --out docs/bench/prefill_serving_gpu.json
    python tools/bench_prefill_serving_gpu.py --configs V3A --contexts 1024,8192,32768,131072 ...
CPU smoke run of the script itself (tiny sizes): --smoke --device cpu

For each config (S and M as in tools/bench_serving_gpu.py; V3A = tools/bench_prefill.py's
4-layer DeepSeek-V3-attention model; every config's max_position_embeddings is raised to fit
the longest context) it
1. writes seeded weights as a checkpoint folder (`bench_serving_gpu.write_checkpoint`);
2. starts `tandem up` (etcd, router, one prefill and one decode worker on the GPU, with
   --chunk-size and --max-prefill-tokens from the flags) and runs `tandem bench`
   (`bench_serving_gpu.serve_and_bench`): for every context C, 3 requests of C fresh tokens one
   at a time (TTFT of one request: the median); then --concurrency requests in flight at
   --concurrency-context tokens, half of them shared by 8 prefix groups as in the trial of
   issue 15 (2 × concurrency requests: TTFT mean / p50 / p99);
3. stops the cluster and, on the same weights in this process, times the engine's own prefill
   (`bench_prefill.BenchRuntime`: the worker's pool, `ModelRunner` and chunk plan, one chunk
   per forward, the first token's logits; no gRPC, no KV transfer) for one prompt of each C,
   and a burst of --concurrency prompts through the worker's `PrefillBatcher` with the same
   prefix groups (all are allocated before any commits, so each computes its whole prompt).

FLOPs counted for an n-token prefill (`prefill_flops`), forward only, 2 FLOPs per
multiply-add: every matmul a token's row passes through once — q (or q_a and q_b), kv_a,
kv_b, o_proj, the dense MLP or the MoE gate plus the shared and the top-k routed experts
(the *active* experts, not all of them) — for all n tokens, the lm_head for the last token
only, plus causal attention, 2·(qk_head_dim + v_head_dim) per head for every (query,
key ≤ query) pair (`bench_prefill.attention_flops`). kv_b_proj applied again to the cached
prefix of every chunk (the expanded MLA form) is work the model does not need and is not
counted. model_tflops = those FLOPs / served TTFT; share_of_peak = model_tflops / 989 (H200
bf16 dense peak); inprocess_model_tflops divides by the in-process TTFT.

Rows (`rows` in the JSON): {"config", "prompt_tokens", "concurrency", "served_ttft_ms",
"inprocess_ttft_ms", "model_tflops", "share_of_peak", ...}; the concurrency row adds
served_ttft_p50_ms / p99 and ttft_vs_single (its mean TTFT ÷ one request's TTFT at the
same prompt length in this run: issue 15 asks ≤ 10).

--trace: the cluster exports OpenTelemetry spans to a receiver in this process
(tests/otlp_receiver.py), and each served row gets "spans": for every span name (service/name)
of its requests' traces, the median start after the router's Generate span began and the
median duration, in ms — where a served TTFT goes between the router, decode and prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
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

from bench_decode import bench_config  # noqa: E402
from bench_prefill import H200_BF16_DENSE_PEAK, attention_flops, make_runtime, sync, ttft  # noqa: E402
from bench_serving_gpu import m_config, serve_and_bench, smoke_config, write_checkpoint  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from engine.prefill_batch import PrefillBatcher  # noqa: E402
from engine.runner import PrefillInput  # noqa: E402

SINGLE_REQUESTS = 3  # served requests per context at concurrency 1 (the median is reported)


def v3a_config() -> ModelConfig:
    from bench_prefill import model_config
    return model_config("h200", None)


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token's row multiplies in the main layers (active experts only)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q = (h * heads * cfg.qk_head_dim if cfg.q_lora_rank is None
         else h * cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_head_dim)
    attn = q + h * cfg.kv_dim + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) \
        + heads * cfg.v_head_dim * h
    dense = 3 * h * cfg.intermediate_size
    moe = h * cfg.n_routed_experts + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * h * cfg.moe_intermediate_size
    k = cfg.first_k_dense_replace
    return cfg.num_hidden_layers * attn + k * dense + (cfg.num_hidden_layers - k) * moe


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """Counted FLOPs of an n-token prefill from scratch (see the module docstring)."""
    return 2.0 * n * active_matmul_params(cfg) + 2.0 * cfg.hidden_size * cfg.vocab_size + attention_flops(n, cfg)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def inprocess_single(rt: Any, cfg: ModelConfig, n: int, device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` cold prefills of n tokens (after one warm-up)."""
    ids = prompt(n, cfg.vocab_size, n)
    asyncio.run(ttft(rt, ids, device))
    return statistics.median(asyncio.run(ttft(rt, ids, device)) for _ in range(repeats))


def inprocess_burst(rt: Any, cfg: ModelConfig, n: int, concurrency: int, budget: int,
                    device: torch.device) -> list[float]:
    """TTFT seconds of `concurrency` prompts of n tokens (n/2 shared by 8 groups) submitted at
    once through a PrefillBatcher on the runtime's model thread, each chunked by its planner."""
    shared = [prompt(n // 2, cfg.vocab_size, 1000 + g) for g in range(8)]
    prompts = [shared[i % 8] + prompt(n - n // 2, cfg.vocab_size, 2000 + i) for i in range(concurrency)]
    pool = rt.pool

    async def one(batcher: PrefillBatcher, ids: list[int], t0: float) -> float:
        p = pool.allocate_prompt(ids)
        try:
            chunks = rt.planner.chunks(p.num_cached_blocks * pool.block_size, len(ids))
            for i, (s, e) in enumerate(chunks):
                out = await batcher.run_chunk(PrefillInput(p.block_ids, ids, s, e, logits=i == len(chunks) - 1))
            await rt.run_model(sync, device)
            assert out.logits is not None
            pool.commit_prompt(p)
            return time.perf_counter() - t0
        finally:
            pool.free(p.block_ids)

    async def main() -> list[float]:
        batcher = PrefillBatcher(rt.run_model, rt.runner.prefill_batch, budget, cfg.vocab_size, pool.block_size)
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(batcher, ids, t0) for ids in prompts))

    return asyncio.run(main())


def span_breakdown(spans: list[Any], window: list[float]) -> dict[str, dict[str, float]]:
    """Median start offset and duration (ms) of each "service/name" over the traces whose root
    span (no parent: the router's Generate) began inside the wall-clock window [t0, t1] s."""
    by_trace: dict[str, list[Any]] = {}
    for sp in spans:
        by_trace.setdefault(sp.trace_id, []).append(sp)
    starts: dict[str, list[float]] = {}
    durs: dict[str, list[float]] = {}
    for trace_spans in by_trace.values():
        roots = [sp for sp in trace_spans if not sp.parent_span_id]
        if len(roots) != 1 or not window[0] <= roots[0].start_ns / 1e9 <= window[1]:
            continue
        t0 = roots[0].start_ns
        for sp in trace_spans:
            key = f"{sp.service.removeprefix('tandem-')}/{sp.name}"
            starts.setdefault(key, []).append((sp.start_ns - t0) / 1e6)
            durs.setdefault(key, []).append((sp.end_ns - sp.start_ns) / 1e6)
    return {k: {"start_ms": round(statistics.median(starts[k]), 2), "ms": round(statistics.median(durs[k]), 2),
                "n": len(durs[k])} for k in sorted(starts, key=lambda k: statistics.median(starts[k]))}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def bench_one(name: str, cfg: ModelConfig, args: argparse.Namespace, device: torch.device,
              contexts: list[int]) -> tuple[list[dict[str, Any]], int]:
    rows: list[dict[str, Any]] = []
    cctx, conc = args.concurrency_context, args.concurrency
    with tempfile.TemporaryDirectory() as tmp:
        work, model_dir = Path(tmp), Path(tmp) / "model"
        params = write_checkpoint(cfg, model_dir, device)
        print(json.dumps({"config": name, "params": params}), flush=True)
        env = {"TANDEM_CHUNK_SIZE": str(args.chunk_size), "TANDEM_MAX_PREFILL_TOKENS": str(args.max_prefill_tokens)}
        if args.smoke:
            env["TANDEM_NUM_BLOCKS"] = "4000"  # GPU: --mem-fraction-static (serve_and_bench)
        # one request at the concurrency row's length too: its TTFT is ttft_vs_single's divisor
        runs = [(n, 1) for n in contexts] + ([] if cctx in contexts else [(cctx, 1)]) + [(cctx, conc)]
        receiver = None
        if args.trace and not args.skip_served:
            from tests.otlp_receiver import OtlpReceiver
            receiver = OtlpReceiver().__enter__()
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200",
                        "OTEL_BSP_MAX_QUEUE_SIZE": "65536"})
        try:
            served = {} if args.skip_served else serve_and_bench(
                model_dir, [], [1, conc], args.output_tokens, args.port, work, env, runs=runs,
                prefix_len=lambda ctx, c: 0 if c == 1 else ctx // 2,
                num_requests=lambda ctx, c: SINGLE_REQUESTS if c == 1 else 2 * c)
            if receiver is not None:
                time.sleep(1.0)  # the workers' last export batches
                for key, summary in served.items():
                    summary["spans"] = span_breakdown(list(receiver.spans), summary["bench_window_s"])
                    print(json.dumps({"config": name, "served": key, "spans": summary["spans"]}), flush=True)
        finally:
            if receiver is not None:
                receiver.__exit__(None, None, None)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, _ = load_checkpoint(model_dir, dtype=dtype, device=device)
        loaded = LoadedModel(f"bench-{name}", cfg, model.eval(), model_dir)
        tokens = max(max(contexts), conc * cctx) + 64
        rt = make_runtime(loaded, tokens, 1, args.chunk_size, "auto", 1 if device.type == "cpu" else 4, device)
        try:
            single: dict[int, float] = {}
            for n in contexts:
                try:
                    single[n] = inprocess_single(rt, cfg, n, device, args.repeats)
                except torch.cuda.OutOfMemoryError as exc:
                    print(json.dumps({"config": name, "prompt_tokens": n, "inprocess": f"OOM {exc}"[:120]}))
                s = served.get((n, 1), {})
                served_ms = s.get("median_ttft_ms")
                flops = prefill_flops(cfg, n)
                tflops = flops / (served_ms / 1e3) / 1e12 if served_ms else None
                ip = single.get(n)
                rows.append({"config": name, "prompt_tokens": n, "concurrency": 1, "served_ttft_ms": served_ms,
                             "inprocess_ttft_ms": ip * 1e3 if ip else None, "model_tflops": tflops,
                             "share_of_peak": tflops * 1e12 / H200_BF16_DENSE_PEAK if tflops else None,
                             "inprocess_model_tflops": flops / ip / 1e12 if ip else None,
                             "served_over_inprocess": served_ms / (ip * 1e3) if served_ms and ip else None,
                             "counted_flops": flops, "failed": s.get("failed"), "spans": s.get("spans")})
                print(json.dumps(rows[-1]), flush=True)
            burst = inprocess_burst(rt, cfg, cctx, conc, args.max_prefill_tokens, device)
            s = served.get((cctx, conc), {})
            one_ms = served.get((cctx, 1), {}).get("median_ttft_ms")
            rows.append({"config": name, "prompt_tokens": cctx, "concurrency": conc,
                         "served_ttft_ms": s.get("mean_ttft_ms"), "served_ttft_p50_ms": s.get("median_ttft_ms"),
                         "served_ttft_p99_ms": s.get("p99_ttft_ms"),
                         "inprocess_ttft_ms": statistics.mean(burst) * 1e3,
                         "inprocess_ttft_p50_ms": percentile(burst, 50) * 1e3,
                         "inprocess_ttft_p99_ms": percentile(burst, 99) * 1e3,
                         "model_tflops": None, "share_of_peak": None,
                         "ttft_vs_single": s["mean_ttft_ms"] / one_ms if s.get("mean_ttft_ms") and one_ms else None,
                         "failed": s.get("failed"), "spans": s.get("spans")})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            rt.close()
            del model, loaded
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, params


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="S,M", help="comma list of S, M, V3A")
    p.add_argument("--contexts", default="1024,8192,32768", help="prompt lengths of the one-request TTFT rows")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--concurrency-context", type=int, default=1024, help="prompt length of the concurrency row")
    p.add_argument("--chunk-size", type=int, default=8192, help="the workers' --chunk-size")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="the workers' --max-prefill-tokens")
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="in-process prefills per context (median)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--trace", action="store_true", help="break each served row down by OpenTelemetry span")
    p.add_argument("--smoke", action="store_true", help="tiny model (a CPU check of the script)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device (torch {torch.__version__}); "
                "run on a GPU machine, or pass --device cpu (with --smoke for a quick check)")
    contexts = [int(x) for x in args.contexts.split(",")]
    longest = max(*contexts, args.concurrency_context) + args.output_tokens + 16
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
                           "peak_flops": H200_BF16_DENSE_PEAK, "rows": [], "params": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.configs.split(","):
        base = smoke_config() if args.smoke else {"S": lambda: bench_config(False), "M": m_config,
                                                  "V3A": v3a_config}[name]()
        cfg = dataclasses.replace(base, max_position_embeddings=max(base.max_position_embeddings, longest))
        rows, doc["params"][name] = bench_one(name, cfg, args, device, contexts)
        doc["rows"] += rows
        out.write_text(json.dumps(doc, indent=1) + "\n")
    print("| config | prompt tokens | concurrency | served TTFT ms | in-process TTFT ms | served / in-process | "
          "model TFLOP/s | share of peak |")
    def cell(value, fmt: str) -> str:  # "—" where a row has no such figure (not 0)
        return "—" if value is None else format(value, fmt)

    for r in doc["rows"]:
        ip = r["inprocess_ttft_ms"]
        sv = r["served_ttft_ms"]
        print(f"| {r['config']} | {r['prompt_tokens']} | {r['concurrency']} | {cell(sv, '.1f')} | {cell(ip, '.1f')} | "
              f"{cell(sv / ip if sv and ip else None, '.2f')} | {cell(r['model_tflops'], '.1f')} | "
              f"{cell(r['share_of_peak'], '.3f')} |")
    return doc


if __name__ == "__main__":
    main()
