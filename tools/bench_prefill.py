"""Benchmark the prefill runtime (docs/bench/prefill.md): TTFT of long prompts by pipeline stages,
static vs dynamic chunking and KV cache dtype; on CUDA also attention FLOP/s against the peak.

TTFT here is the prefill worker's own part: `WorkerRuntime.prefill` of the whole prompt into its
pool (chunks, all stages, the first token's logits), without gRPC and without a KV transfer
(the transfer has its own benchmark, tools/bench_transfer.py). Weights are random (timing does
not depend on them); the prompt is a LongBench-v2 context (../shared/datasets/prompts/
longbench2_md_short, tokenized with the Qwen2 tokenizer, ids folded into the model's vocabulary,
several contexts joined when one is too short), or arbitrary ids when the dataset is absent.

Presets:
  cpu   hidden 1024, 4 dense layers, MLA 256/32 with 8 heads of 64+32 (v 64), float32, chunk
        2048; lengths 8K and 16K; cases pp 1 static, pp 2 static, pp 2 dynamic. Each stage gets
        one torch thread, so pp 2 uses two cores where pp 1 uses one (the CPU analogue of 1 vs
        2 GPUs).
  h200  DeepSeek-V3 attention (hidden 7168, MLA q 1536 / kv 512 / rope 64 / nope 128 / v 128,
        128 heads), 4 dense layers (intermediate 18432), bf16, chunk 8192; lengths 32K and 128K;
        cases pp 1 with BF16 KV static, FP8 KV static, BF16 KV dynamic; attention kernel time
        from torch.profiler at the longest length. One GPU: no multi-GPU pipeline.

Each case runs `--repeats` times (after a warm-up prefill of 1K tokens per runtime); the median
is reported. Ratios compare cases of the same run.

`--modeled` (for a CPU shared with other work, where two stage processes cannot count on two
free cores): run each chunk plan once in this process, timing every (chunk, stage) in thread CPU
time, and compute the pipeline's finish time with each stage on its own core (`makespan`); the
dynamic plan's fit is timed in CPU time too. It leaves out the stage-to-stage sends (a chunk's
hidden states, [chunk, hidden] float32: 8 MB for 2048 × 1024, milliseconds on loopback).

Usage:
  python tools/bench_prefill.py --preset cpu --out docs/bench/prefill_cpu.json
  python tools/bench_prefill.py --preset cpu --modeled --skip-measured --out docs/bench/prefill_cpu_modeled.json
  python tools/bench_prefill.py --preset h200 --device cuda --out /tmp/prefill_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from engine.chunking import make_planner, profile_lengths  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.kv_pool import KvPool, KvPoolConfig, kv_cache_torch_dtype  # noqa: E402
from engine.model import DeepseekV3ForCausalLM  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from engine.pipeline import Pipeline, partition_layers  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402

DATASET = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "prompts" / "longbench2_md_short"
REPEATS = 1  # --repeats
H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, NVIDIA H200 SXM datasheet (dense, no sparsity)


def model_config(preset: str, layers: int | None) -> ModelConfig:
    base = ModelConfig.tiny()
    if preset == "cpu":
        n = layers or 4
        return dataclasses.replace(
            base, vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=n,
            first_k_dense_replace=n, num_attention_heads=8, q_lora_rank=384, kv_lora_rank=256,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_nextn_predict_layers=0,
            max_position_embeddings=32768, bos_token_id=0, eos_token_id=1)
    n = layers or 4
    return dataclasses.replace(
        base, vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=n,
        first_k_dense_replace=n, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=2, n_group=1,
        topk_group=1, num_experts_per_tok=1, moe_intermediate_size=2048, num_nextn_predict_layers=0,
        max_position_embeddings=163840, bos_token_id=0, eos_token_id=1)


@torch.no_grad()
def build(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> DeepseekV3ForCausalLM:
    """Random weights drawn on the device (engine.model.init_weights draws on the CPU: minutes
    for billions of parameters)."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config, dtype=dtype, device=device)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, config.initializer_range)
    return model.eval().requires_grad_(False)


def prompt_ids(n: int, vocab: int) -> tuple[list[int], str]:
    files = sorted(DATASET.glob("*/*_context.txt"), key=lambda p: (-p.stat().st_size, str(p))) if DATASET.exists() else []
    if not files:
        return [(7 * i + 3) % vocab for i in range(n)], "arbitrary ids (dataset not found)"
    from common.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    ids: list[int] = []
    used = []
    for f in files:
        ids += tok.encode(f.read_text(encoding="utf-8"))
        used.append(str(f.relative_to(DATASET)))
        if len(ids) >= n:
            break
    while len(ids) < n:  # fewer tokens in the whole dataset: repeat
        ids += ids
    return [t % vocab for t in ids[:n]], "LongBench-v2 " + " + ".join(used)


class BenchRuntime:
    """The prefill side of `worker.host.WorkerRuntime` without its gRPC, discovery and
    transfer parts (the H200 image lacks grpcio-health-checking, grpcio-reflection and NIXL):
    the same pool, `ModelRunner`, chunk planner and `Pipeline`, driven by the same calls as
    `WorkerRuntime.prefill`, on one model thread."""

    def __init__(self, loaded: LoadedModel, tokens: int, pp: int, chunk: int, kv_dtype: str, threads: int,
                 device: torch.device) -> None:
        cfg = loaded.config
        torch.set_num_threads(threads)
        self.device = loaded.model.model.embed_tokens.weight.device
        self.pool = KvPool(KvPoolConfig(tokens // 16 + 8, 16, cfg.num_hidden_layers, cfg.kv_dim,
                                        dtype=kv_cache_torch_dtype(kv_dtype, loaded.model.dtype)), 0,
                           device=self.device)
        self.runner = ModelRunner(loaded.model, self.pool)
        self.planner = make_planner(chunk, 16, False, 0.75)
        self.pipeline = None
        if pp > 1:
            if self.device.type == "cpu":
                self.pool.kv.share_memory_()
            self.pipeline = Pipeline(loaded.model, self.pool.kv, self.pool.config,
                                     partition_layers(cfg.num_hidden_layers, pp), self.device, threads)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run_model(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def prefill(self, block_ids: list[int], token_ids: list[int], start: int) -> torch.Tensor:
        chunks = self.planner.chunks(start, len(token_ids))  # as WorkerRuntime.prefill
        if self.pipeline is not None:
            return await self.pipeline.prefill(self, block_ids, token_ids, chunks, None)  # type: ignore[arg-type]
        hidden = None
        for s, e in chunks:
            hidden = await self.run_model(self.runner.prefill_chunk, block_ids, token_ids, s, e)
        return await self.run_model(self.runner.logits, hidden)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        self._executor.shutdown(wait=True)


def make_runtime(loaded: LoadedModel, tokens: int, pp: int, chunk: int, kv_dtype: str, threads: int,
                 device: torch.device) -> BenchRuntime:
    return BenchRuntime(loaded, tokens, pp, chunk, kv_dtype, threads, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def ttft(rt: BenchRuntime, ids: list[int], device: torch.device) -> float:
    blocks = rt.pool.blocks.allocate(rt.pool.blocks_for(len(ids)))
    try:
        sync(device)
        t0 = time.perf_counter()
        await rt.prefill(blocks, ids, 0)
        sync(device)
        return time.perf_counter() - t0
    finally:
        rt.pool.free(blocks)


def attention_flops(n: int, cfg: ModelConfig) -> float:
    """Causal attention FLOPs of an n-token prefill over all layers: every (query, key ≤ query)
    pair costs 2·qk_head_dim (scores) + 2·v_head_dim (weighted values) per head."""
    pairs = n * (n + 1) / 2
    return 2 * pairs * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * cfg.num_hidden_layers


async def attention_kernel_seconds(rt: BenchRuntime, ids: list[int]) -> tuple[float, list[str]]:
    """Device time of the attention kernels (flash / memory-efficient SDPA) in one prefill."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        await ttft(rt, ids, rt.device)
    names, total_us = set(), 0.0
    for e in prof.key_averages():
        key = e.key.lower()
        # kernels only (an aten:: op's device time would count its kernels a second time)
        if key.startswith("aten::") or str(getattr(e, "device_type", "")).split(".")[-1] not in ("CUDA", ""):
            continue
        if any(k in key for k in ("flash", "fmha", "attention")):
            total_us += getattr(e, "self_device_time_total", 0.0) or getattr(e, "device_time_total", 0.0)
            names.add(e.key[:80])
    return total_us / 1e6, sorted(names)


@torch.inference_mode()
def attention_last_chunk(cfg: ModelConfig, n: int, chunk: int, device: torch.device,
                         dtype: torch.dtype) -> dict[str, float]:
    """One layer's attention for the last chunk of an n-token prompt (T = chunk queries over
    S = n keys), timed alone with CUDA events: `mla_attention` whole (kv_b expansion + SDPA)
    and the SDPA kernel on its own. FLOPs count only the causal pairs."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from engine.model import mla_attention
    h, t, s = cfg.num_attention_heads, chunk, n
    g = torch.Generator(device=device).manual_seed(0)
    q_nope = torch.randn(t, h, cfg.qk_nope_head_dim, device=device, dtype=dtype, generator=g)
    q_pe = torch.randn(t, h, cfg.qk_rope_head_dim, device=device, dtype=dtype, generator=g)
    ctx = torch.randn(s, cfg.kv_dim, device=device, dtype=dtype, generator=g)
    kv_b = torch.randn(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, device=device,
                       dtype=dtype, generator=g) * 0.02
    positions = torch.arange(s - t, s, device=device)
    qk = cfg.qk_head_dim
    q = torch.randn(1, h, t, qk, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, h, s, qk, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, h, s, qk, device=device, dtype=dtype, generator=g)  # v padded to qk, as mla_attention
    mask = causal_lower_right(t, s)

    def timed(fn) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 3 / 1e3

    mla_s = timed(lambda: mla_attention(q_nope, q_pe, ctx, positions, kv_b, cfg.kv_lora_rank, cfg.v_head_dim,
                                        qk ** -0.5))
    sdpa_s = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=qk ** -0.5))
    pairs = t * s - t * (t - 1) / 2
    flops = 2 * pairs * h * (qk + cfg.v_head_dim)
    return dict(queries=t, keys=s, flops=flops, mla_attention_s=mla_s, sdpa_s=sdpa_s,
                mla_attention_tflops=flops / mla_s / 1e12, sdpa_tflops=flops / sdpa_s / 1e12,
                sdpa_fraction_of_h200_peak=flops / sdpa_s / H200_BF16_DENSE_PEAK)


@torch.inference_mode()
def stage_costs(loaded: LoadedModel, ids: list[int], plan: list[tuple[int, int]],
                ranges: list[tuple[int, int]]) -> list[list[float]]:
    """CPU seconds (this thread's, `time.thread_time`: robust to other processes on a shared
    machine) of every (chunk, stage) of a pipelined prefill, run in this process: stage 0
    embeds, the last stage adds the final logits. [chunks][stages]."""
    from engine.kv_pool import KvPool, PagedKvCache
    cfg = loaded.config
    pool = KvPool(KvPoolConfig(len(ids) // 16 + 8, 16, cfg.num_hidden_layers, cfg.kv_dim,
                               dtype=loaded.model.dtype), 0)
    blocks = list(range(pool.blocks_for(len(ids))))
    model = loaded.model
    out = []
    for s, e in plan:
        row = []
        positions = torch.arange(s, e)
        cache = PagedKvCache(pool, [(blocks, s, e - s)])
        x = None
        for k, (a, b) in enumerate(ranges):
            t0 = time.thread_time()
            if k == 0:
                x = model.model.embed_tokens(torch.tensor(ids[s:e]))
            x = model.run_layers(x, positions, [e - s], cache, a, b)
            if k == len(ranges) - 1 and e == len(ids):
                model.logits(model.model.norm(x[-1:]))
            row.append(time.thread_time() - t0)
        out.append(row)
    return out


def makespan(costs: list[list[float]]) -> float:
    """Finish time of the last chunk on the last stage when each stage has its own core and
    a stage takes chunks in order: f[k][j] = max(f[k-1][j], f[k][j-1]) + c[k][j]."""
    stages = len(costs[0])
    prev = [0.0] * stages
    for row in costs:
        cur = []
        for j, c in enumerate(row):
            cur.append(max(prev[j], cur[j - 1] if j else 0.0) + c)
        prev = cur
    return prev[-1]


def cpu_time_prefill(loaded: LoadedModel, lengths: list[int]) -> list[float]:
    """Thread CPU seconds of one-chunk prefills of `lengths` tokens (the fit's samples)."""
    from engine.kv_cache_contiguous import ContiguousKvCache
    cfg = loaded.config
    out = []
    with torch.inference_mode():
        for n in lengths:
            ids, pos = torch.arange(n) % cfg.vocab_size, torch.arange(n)
            t0 = time.thread_time()
            loaded.model.forward(ids, pos, [n], ContiguousKvCache(cfg.num_hidden_layers))
            out.append(time.thread_time() - t0)
    return out


def modeled_pipeline(loaded: LoadedModel, ids: list[int], chunk: int, smoothing: float,
                     pp: int) -> dict[str, object]:
    """pp 1 vs pp stages and static vs dynamic chunks from CPU-time costs (module doc)."""
    from engine.pipeline import partition_layers
    cfg = loaded.config
    fit_lengths = profile_lengths(chunk, 16, len(ids))
    fit_cpu = cpu_time_prefill(loaded, fit_lengths)
    dynamic = make_planner(chunk, 16, True, smoothing, fit_lengths, fit_cpu)
    static = make_planner(chunk, 16, False, smoothing)
    ranges = partition_layers(cfg.num_hidden_layers, pp)
    out: dict[str, object] = dict(fit_lengths=fit_lengths, fit_cpu_s=fit_cpu, fit_usable=dynamic.dynamic)
    for name, planner in (("static", static), ("dynamic", dynamic)):
        plan = planner.chunks(0, len(ids))
        costs = stage_costs(loaded, ids, plan, ranges)
        total = sum(map(sum, costs))
        out[name] = dict(chunks=[e - s for s, e in plan], pp1_s=total, pipelined_s=makespan(costs),
                         speedup=total / makespan(costs), stage_cpu_s=[sum(r[j] for r in costs) for j in range(pp)])
    return out


async def run_case(loaded: LoadedModel, cfg: ModelConfig, ids: list[int], case: str, pp: int, mode: str,
                   kv: str, chunk: int, planner, device: torch.device, dtype: torch.dtype, profile: bool,
                   microbench: bool) -> dict:
    n = len(ids)
    rt = make_runtime(loaded, n, pp, chunk, kv, 1 if device.type == "cpu" else 4, device)
    try:
        if mode == "dynamic":
            rt.planner = planner
        await ttft(rt, ids[:1024], device)  # warm-up (and stage start-up)
        times = [await ttft(rt, ids, device) for _ in range(REPEATS)]
        row = dict(case=case, tokens=n, pp=pp, chunking=mode, kv_cache_dtype=rt.pool.config.dtype_name,
                   ttft_s=statistics.median(times), runs_s=times, chunks=[e - s for s, e in rt.planner.chunks(0, n)],
                   kv_bytes_per_token=rt.pool.config.bytes_per_token)
        attn_flops = attention_flops(n, cfg)
        row["attention_flops"] = attn_flops
        row["attention_flops_per_s_of_ttft"] = attn_flops / row["ttft_s"]
        if profile:
            secs, names = await attention_kernel_seconds(rt, ids)
            row.update(attention_kernel_s=secs, attention_kernels=names,
                       attention_tflops=attn_flops / secs / 1e12 if secs else None,
                       attention_fraction_of_peak=attn_flops / secs / H200_BF16_DENSE_PEAK if secs else None)
    finally:
        rt.close()
    if microbench:
        try:
            row["attention_last_chunk"] = attention_last_chunk(cfg, n, chunk, device, dtype)
        except Exception as exc:  # noqa: BLE001 - keep the TTFT row
            row["attention_last_chunk"] = dict(error=f"{type(exc).__name__}: {exc}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("cpu", "h200"), default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="", help="comma-separated prompt lengths (default by preset)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=0, help="base chunk (default 2048 cpu, 8192 h200)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--smoothing", type=float, default=0.75)
    ap.add_argument("--cases", default="", help="e.g. 'pp1-static,pp2-static,pp2-dynamic,pp1-static-fp8'")
    ap.add_argument("--modeled", action="store_true",
                    help="also model the pipeline from per-stage CPU time (for a busy shared CPU machine)")
    ap.add_argument("--skip-measured", action="store_true", help="with --modeled: skip the wall-clock cases")
    ap.add_argument("--out", default="", help="write results as JSON here")
    args = ap.parse_args()
    global REPEATS
    REPEATS = args.repeats

    device = torch.device(args.device)
    cfg = model_config(args.preset, args.layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        [8192, 16384] if args.preset == "cpu" else [32768, 131072])
    chunk = args.chunk or (2048 if args.preset == "cpu" else 8192)
    cases = args.cases.split(",") if args.cases else (
        ["pp1-static", "pp2-static", "pp2-dynamic"] if args.preset == "cpu"
        else ["pp1-static", "pp1-static-fp8", "pp1-dynamic"])
    torch.set_num_threads(1 if device.type == "cpu" else 4)

    t0 = time.perf_counter()
    loaded = LoadedModel("bench-prefill", cfg, build(cfg, device, dtype), None)
    build_s = time.perf_counter() - t0
    print(f"model: {sum(p.numel() for p in loaded.model.parameters()) / 1e9:.2f} B parameters, "
          f"{dtype}, {device}; built in {build_s:.1f} s", flush=True)

    modeled = {}
    if args.modeled:
        for n in lengths:
            modeled[n] = modeled_pipeline(loaded, prompt_ids(n, cfg.vocab_size)[0], chunk, args.smoothing, 2)
            print(json.dumps({"modeled": n, **modeled[n]}), flush=True)
    if args.skip_measured:
        lengths = []
    # dynamic chunking's fit: timed once on the whole model, shared by every dynamic case
    fit_lengths = profile_lengths(chunk, 16, max(lengths or [chunk]))
    fit_seconds: list[float] = []
    planner = make_planner(chunk, 16, False, args.smoothing)
    if lengths:
        probe = make_runtime(loaded, max(lengths + [1024]), 1, chunk, "auto", 1, device)
        await ttft(probe, list(range(1024)), device)  # warm-up
        fit_seconds = probe.runner.time_prefill(fit_lengths, repeats=1)
        planner = make_planner(chunk, 16, True, args.smoothing, fit_lengths, fit_seconds)
        probe.close()
        print("fit samples:", {n: round(s, 4) for n, s in zip(fit_lengths, fit_seconds)},
              "dynamic" if planner.dynamic else "static fallback", flush=True)

    results = []
    for n in lengths:
        ids, source = prompt_ids(n, cfg.vocab_size)
        for case in cases:
            parts = case.split("-")
            pp, mode = int(parts[0].removeprefix("pp")), parts[1]
            kv = "fp8_e4m3" if "fp8" in parts[2:] else "auto"
            try:
                row = await run_case(loaded, cfg, ids, case, pp, mode, kv, chunk, planner, device, dtype,
                                     profile=device.type == "cuda" and n == max(lengths) and case == cases[0],
                                     microbench=device.type == "cuda" and case == cases[0])
            except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
                row = dict(case=case, tokens=n, error=f"{type(exc).__name__}: {exc}")
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("chunks", "attention_kernels")}), flush=True)

    def ratio(a: str, b: str, n: int) -> float | None:
        r = {x["case"]: x["ttft_s"] for x in results if x["tokens"] == n and "ttft_s" in x}
        return r[a] / r[b] if a in r and b in r else None

    ratios = {n: {"pp1-static / pp2-static": ratio("pp1-static", "pp2-static", n),
                  "pp2-static / pp2-dynamic": ratio("pp2-static", "pp2-dynamic", n),
                  "pp1-static / pp1-dynamic": ratio("pp1-static", "pp1-dynamic", n),
                  "pp1-static-fp8 / pp1-static": ratio("pp1-static-fp8", "pp1-static", n)} for n in lengths}
    kv_formula = {name: (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * b
                  for name, b in (("bf16", 2), ("fp8_e4m3", 1))}
    kv_measured = {name: KvPoolConfig(1, 16, cfg.num_hidden_layers, cfg.kv_dim,
                                      dtype=kv_cache_torch_dtype(name, torch.bfloat16)).bytes_per_token
                   for name in ("bf16", "fp8_e4m3")}
    source = prompt_ids(16, cfg.vocab_size)[1]
    summary = dict(preset=args.preset, device=str(device),
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                   torch=torch.__version__, model=dataclasses.asdict(cfg), dtype=str(dtype), chunk=chunk,
                   prompt_source=source, fit=dict(lengths=fit_lengths, seconds=fit_seconds,
                                                  a_b_c=dataclasses.astuple(planner.fit) if planner.fit else None),
                   results=results, modeled={str(k): v for k, v in modeled.items()}, ratios={str(k): v for k, v in ratios.items()},
                   kv_bytes_per_token=dict(formula=kv_formula, pool=kv_measured),
                   command=" ".join(sys.argv))
    print(json.dumps(dict(ratios=summary["ratios"], kv_bytes_per_token=summary["kv_bytes_per_token"])), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    asyncio.run(main())
