"""Where a prefill's GPU time goes: the worker's own prefill forward (`ModelRunner.prefill_batch`,
fast mode) on config S, M or V3A, kernels grouped into attention / MoE experts / GEMMs / other,
with the counted FLOP/s of tools/bench_prefill_serving_gpu.py; plus the attention and MoE ops
alone at the same shapes with each available implementation, so a choice between them rests on
a measurement of this GPU.

Usage (CUDA only; seeded N(0, 0.02) weights drawn on the GPU, no checkpoint written):
    python tools/profile_prefill.py --config M --tokens 8192,32768 --chunk 8192 [--out FILE]
    python tools/profile_prefill.py --config S --batch 1:0:1024,32:512:512 (one batched forward)

Per (tokens, chunk): wall ms of the whole prefill (median of 3, after one warm-up), counted
TFLOP/s and share of 989 TFLOP/s, and one profiled run's kernel time per group. Then, per
chunk shape (T queries over S context rows, the last chunk of the longest prompt): SDPA time
of each backend that accepts MLA's shapes (v padded to the qk head size where the backend needs
one size), and the routed experts of T tokens through the Triton fused MoE kernels against
`torch._grouped_mm` on the same sorted pairs. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_decode import bench_config  # noqa: E402
from bench_prefill_serving_gpu import H200_BF16_DENSE_PEAK, prefill_flops, prompt, v3a_config  # noqa: E402
from bench_serving_gpu import m_config  # noqa: E402
from profile_decode import seeded_model  # noqa: E402
from engine.kv_pool import KvPool, KvPoolConfig  # noqa: E402
from engine.runner import ModelRunner, PrefillInput  # noqa: E402

GROUPS = (  # first match wins; names lower-cased
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("moe_experts", ("_gate_up_kernel", "_down_kernel", "_align_kernel", "grouped")),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "cublas", "xmma", "s16816", "wgmma")),
    ("copy_cat_index", ("copy", "cat", "index", "gather", "scatter", "fill")),
)


def group_of(name: str) -> str:
    n = name.lower()
    for g, keys in GROUPS:
        if any(k in n for k in keys):
            return g
    return "other"


def sync() -> None:
    torch.cuda.synchronize()


def run_prefill(runner: ModelRunner, pool: KvPool, ids: list[int], chunk: int) -> float:
    """Seconds of one prefill of ids from scratch, chunk tokens per forward (the last asks logits)."""
    blocks = pool.blocks.allocate(pool.blocks_for(len(ids)))
    try:
        sync()
        t0 = time.perf_counter()
        starts = list(range(0, len(ids), chunk))
        for i, s in enumerate(starts):
            runner.prefill_batch([PrefillInput(blocks, ids, s, min(len(ids), s + chunk),
                                               logits=i == len(starts) - 1)])
        sync()
        return time.perf_counter() - t0
    finally:
        pool.blocks.free(blocks)


def kernel_groups(runner: ModelRunner, pool: KvPool, ids: list[int], chunk: int) -> dict[str, float]:
    """Kernel ms per group (and 'kernels': launches) of one profiled prefill."""
    return profiled_kernels(lambda: run_prefill(runner, pool, ids, chunk))


def profiled_kernels(fn, top_n: int = 12) -> dict:
    """Kernel ms per group, 'kernels' (launches) and 'top' ([[ms, count, name], ...], the top_n
    kernel names by their summed ms) of one profiled call of fn."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    out: dict[str, float] = defaultdict(float)
    top: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        out[group_of(e.name)] += us / 1e3
        top[e.name[:90]][0] += us / 1e3
        top[e.name[:90]][1] += 1
        out["kernels"] += 1
    out["top"] = sorted(([round(v[0], 4), v[1], k] for k, v in top.items()), reverse=True)[:top_n]  # type: ignore[assignment]
    return dict(out)


def batch_rows(runner: ModelRunner, pool: KvPool, cfg, n: int, prefix: int, suffix: int) -> list[dict]:
    """One prefill forward of n chunks of `suffix` tokens, each over its own cached `prefix`
    (computed first, not timed): wall ms (median of 5) and kernels of one profiled forward,
    with the batch's short chunks in one varlen attention call (the worker's path) and with the
    per-sequence attention (`mla_attention` chunk by chunk, the reference path); the profiled
    forward's kernel ms per group and its 40 costliest kernel names ("top": [ms, launches, name])."""
    import engine.runner as runner_mod
    tables = [pool.blocks.allocate(pool.blocks_for(prefix + suffix)) for _ in range(n)]
    ids = [prompt(prefix + suffix, cfg.vocab_size, 7 + i) for i in range(n)]
    try:
        if prefix:
            for t, x in zip(tables, ids):
                runner.prefill_batch([PrefillInput(t, x, 0, prefix)])
        batch = [PrefillInput(t, x, prefix, prefix + suffix, logits=True) for t, x in zip(tables, ids)]
        packed_cache = runner_mod.PagedKvCache
        rows = []
        for name, cache in (("packed", packed_cache),
                            ("per_sequence", lambda pool, seqs, pack=False: packed_cache(pool, seqs))):
            runner_mod.PagedKvCache = cache
            try:
                def once() -> float:
                    sync()
                    t0 = time.perf_counter()
                    runner.prefill_batch(batch)
                    sync()
                    return time.perf_counter() - t0
                once()
                ms = 1e3 * statistics.median(once() for _ in range(5))
                prof = profiled_kernels(once, top_n=40)
            finally:
                runner_mod.PagedKvCache = packed_cache
            rows.append({"batch": n, "prefix": prefix, "suffix": suffix, "attention": name, "ms": round(ms, 3),
                         "kernels": int(prof.pop("kernels")), "top": prof.pop("top"),
                         "kernel_ms": {k: round(v, 3) for k, v in prof.items()}})
        return rows
    finally:
        for t in tables:
            pool.blocks.free(t)


def time_op(fn, reps: int = 10) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def attention_shapes(cfg, t: int, s: int) -> list[dict]:
    """SDPA of t queries over s keys (lower-right causal) with MLA's head sizes, per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    h, qk, vd = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    dev = torch.device("cuda")
    q = torch.randn(1, h, t, qk, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, h, s, qk, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, h, s, vd, device=dev, dtype=torch.bfloat16)
    vp = F.pad(v, (0, qk - vd))
    flops = 2 * h * (qk + vd) * (t * (t + 1) / 2 + t * (s - t))
    rows = []
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        for vv, padded in ((v, False), (vp, True)):
            mask = causal_lower_right(t, s) if t != s else None
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    sec = time_op(lambda: F.scaled_dot_product_attention(q, k, vv, attn_mask=mask, is_causal=t == s,
                                                                         scale=qk ** -0.5))
                rows.append({"op": "sdpa", "backend": backend, "v_padded": padded, "t": t, "s": s,
                             "ms": sec * 1e3, "counted_tflops": flops / sec / 1e12})
            except Exception as exc:  # noqa: BLE001 - a backend that refuses these shapes is a result
                rows.append({"op": "sdpa", "backend": backend, "v_padded": padded, "t": t, "s": s,
                             "error": f"{type(exc).__name__}: {exc}"[:160]})
    from engine.kernels.prefill_attention import prefix_causal_attention
    try:
        sec = time_op(lambda: prefix_causal_attention(q, k, v, qk ** -0.5))
        rows.append({"op": "sdpa", "backend": "prefix_causal_attention (split, merged by lse)", "v_padded": False,
                     "t": t, "s": s, "ms": sec * 1e3, "counted_tflops": flops / sec / 1e12})
    except Exception as exc:  # noqa: BLE001
        rows.append({"op": "sdpa", "backend": "prefix_causal_attention", "t": t, "s": s,
                     "error": f"{type(exc).__name__}: {exc}"[:160]})
    return rows


def fresh_shape_cost(cfg, base: int = 1000) -> list[dict]:
    """Attention at prompt lengths not seen before in this process (served prompts vary): the
    first call's ms (cuDNN builds a graph per shape) against the second's."""
    from engine.kernels.prefill_attention import attention_lse
    h, qk, vd = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    rows = []
    for i, t in enumerate((base + 3, base + 17, 2 * base + 5)):
        q = torch.randn(1, h, t, qk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, h, t, qk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, h, t, vd, device="cuda", dtype=torch.bfloat16)
        times = []
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            attention_lse(q, k, v, True, qk ** -0.5)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        rows.append({"op": "attention_fresh_shape", "t": t, "first_ms": times[0], "second_ms": times[1]})
    return rows


def align_shapes(num_experts: int, top_k: int) -> list[dict]:
    """The MoE pair sort: the one-program Triton kernel against torch's launches, per pair count."""
    from engine.kernels.fused_moe import align, align_triton, block_m_for
    rows = []
    for t in (64, 256, 683, 1024, 4096, 32768):
        p = t * top_k
        ids = torch.randint(0, num_experts, (p,), device="cuda")
        bm = block_m_for(p, num_experts)
        rows.append({"op": "align", "pairs": p, "block_m": bm,
                     "triton_one_program_us": time_op(lambda: align_triton(ids, num_experts, bm), 50) * 1e6,
                     "torch_us": time_op(lambda: align(ids, num_experts, bm), 50) * 1e6})
    return rows


def moe_shapes(model, cfg, t: int) -> list[dict]:
    """Routed experts of t tokens: Triton fused MoE against torch._grouped_mm on sorted pairs."""
    from engine.model import MoE
    moe = next(m for m in model.modules() if isinstance(m, MoE) and m.grouped is not None)
    g = moe.grouped
    dev = g.gate_up.device
    x = torch.randn(t, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    ids, w = moe.gate(x)
    k = ids.shape[1]
    flops = 2 * t * k * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    rows = [{"op": "moe", "impl": "triton_fused", "t": t,
             "ms": (sec := time_op(lambda: g.forward(x, ids, w))) * 1e3, "tflops": flops / sec / 1e12}]
    gm = getattr(torch, "_grouped_mm", None)
    if gm is None:
        rows.append({"op": "moe", "impl": "torch._grouped_mm", "error": "not in this torch"})
        return rows
    wgu = g.gate_up.transpose(1, 2)  # [E, hidden, 2I]
    wd = g.down.transpose(1, 2)  # [E, I, hidden]
    inter = g.intermediate

    def grouped() -> torch.Tensor:
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=g.num_experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[order // k]
        hgu = gm(xs, wgu, offs=offs)
        hh = F.silu(hgu[:, :inter]) * hgu[:, inter:]
        y = gm(hh, wd, offs=offs).float() * w.reshape(-1)[order, None]
        out = torch.zeros(t * k, cfg.hidden_size, device=dev, dtype=torch.float32)
        out[order] = y
        return out.view(t, k, -1).sum(1).to(x.dtype)

    try:
        sec = time_op(grouped)
        ref = g.forward(x, ids, w).float()
        err = (grouped().float() - ref).abs().max().item()
        rows.append({"op": "moe", "impl": "torch._grouped_mm", "t": t, "ms": sec * 1e3,
                     "tflops": flops / sec / 1e12, "max_abs_diff_vs_triton": err})
    except Exception as exc:  # noqa: BLE001
        rows.append({"op": "moe", "impl": "torch._grouped_mm", "t": t, "error": f"{type(exc).__name__}: {exc}"[:160]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("S", "M", "V3A"), default="M")
    ap.add_argument("--tokens", default="8192,32768", help="prompt lengths (default 8192,32768)")
    ap.add_argument("--chunk", default="8192", help="comma-separated chunk sizes (default 8192)")
    ap.add_argument("--no-ops", action="store_true", help="skip the per-op comparisons")
    ap.add_argument("--batch", default="", help="N:PREFIX:SUFFIX,... one forward of N chunks of SUFFIX tokens "
                    "over PREFIX cached ones each, packed attention against per-sequence (then exits)")
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_prefill.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    cfg = {"M": m_config, "S": lambda: bench_config(False), "V3A": v3a_config}[args.config]()
    tokens = [int(x) for x in args.tokens.split(",")]
    chunks = [int(x) for x in args.chunk.split(",")]
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max(tokens) + 64))
    lines: list[dict] = []

    def emit(d: dict) -> None:
        lines.append(d)
        print(json.dumps(d), flush=True)

    t0 = time.time()
    model = seeded_model(cfg, torch.device("cuda"))
    batch_tokens = [int(n) * (int(a) + int(b) + 16) for n, a, b in (x.split(":") for x in args.batch.split(",") if x)]
    pool = KvPool(KvPoolConfig(max(tokens + batch_tokens) // 16 + 16, 16, cfg.num_hidden_layers, cfg.kv_dim,
                               dtype=torch.bfloat16), 0, torch.device("cuda"))
    runner = ModelRunner(model, pool)
    runner.warm_up_prefill()
    emit({"config": args.config, "weights_s": round(time.time() - t0, 1), "device": torch.cuda.get_device_name()})
    if args.batch:
        for spec in args.batch.split(","):
            n, pre, suf = (int(x) for x in spec.split(":"))
            for row in batch_rows(runner, pool, cfg, n, pre, suf):
                emit({"config": args.config, **row})
        if args.out:
            args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return
    for n in tokens:
        ids = prompt(n, cfg.vocab_size, n)
        for c in chunks:
            try:
                run_prefill(runner, pool, ids, c)
                ms = 1e3 * statistics.median(run_prefill(runner, pool, ids, c) for _ in range(3))
                flops = prefill_flops(cfg, n)
                groups = kernel_groups(runner, pool, ids, c)
                emit({"config": args.config, "tokens": n, "chunk": c, "ms": ms,
                      "counted_tflops": flops / ms / 1e9, "share_of_peak": flops / (ms / 1e3) / H200_BF16_DENSE_PEAK,
                      "kernel_ms": {k: round(v, 2) for k, v in groups.items() if k not in ("top",)},
                      "top": groups["top"]})
            except torch.cuda.OutOfMemoryError as exc:
                emit({"config": args.config, "tokens": n, "chunk": c, "error": f"OOM {exc}"[:160]})
            torch.cuda.empty_cache()
    if not args.no_ops:
        n = max(tokens)
        for c in chunks:
            t = min(c, n)
            for row in attention_shapes(cfg, t, n):
                emit({"config": args.config, **row})
            if cfg.n_routed_experts:
                for row in moe_shapes(model, cfg, t):
                    emit({"config": args.config, **row})
        for row in fresh_shape_cost(cfg):
            emit({"config": args.config, **row})
        if cfg.n_routed_experts:
            for row in align_shapes(cfg.n_routed_experts, cfg.num_experts_per_tok):
                emit({"config": args.config, **row})
    if args.out:
        args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
