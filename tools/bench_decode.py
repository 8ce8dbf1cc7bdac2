"""Decode throughput of the engine's GPU hot path, against transformers and the HBM bound;
MTP accept length and per-user speed (issue 7 benchmarks).

Usage (one H200, < 8 minutes):
    python tools/bench_decode.py --device cuda --out docs/bench/spec_gpu.json
CPU smoke run (tiny sizes, a minute):
    python tools/bench_decode.py --device cpu --smoke --out /tmp/bench_decode.json

Parts, each written to OUT (JSON) and OUT with .md (tables):
1. decode: a DeepSeek-V3-style config (8 layers, 32 routed experts top-4 + 1 shared, MLA
   kv_lora_rank 512 / rope 64, ~490M parameters, bf16) with weights from transformers' own
   random init (saved with save_pretrained, loaded with engine/loader.py: the same weights in
   both). For batch B and context C the KV pool is filled with random latents (decode speed
   does not depend on their values, and it spares a B × C-token prefill), then greedy decode
   steps run through the worker's own step, `ModelRunner.decode_step` (host plan, the CUDA
   graph of engine/graph_runner.py with the Triton paged MLA decode kernel and fused MoE
   experts, device sampling). tokens/s = B × steps / seconds.
   The plain engine path (per-sequence attention, per-expert loop) is timed at C = 1K too.
2. transformers: `generate` on the same weights with a real C-token prompt; decode tokens/s =
   B × (N − 1) / (t(N new tokens) − t(1 new token)), so its prefill is excluded.
3. bound: bytes read per step = weights touched (all but the embedding table; routed experts
   scaled by the expected fraction hit, 1 − (1 − k/E)^B, uniform routing assumed) + the KV
   latents of the batch (B × C × kv_dim × layers × 2 bytes); time = bytes / HBM bandwidth
   (--hbm-tbps, 4.8 TB/s for an H200); the table reports measured / bound.
4. mtp: accept length (tokens emitted per verify step) and tokens/s per user for k = 0..3 on
   the trained engine/assets/tandem-shakespeare checkpoint (float32, batch 1, greedy, prompts
   from tests/data/shakespeare_val_slice.txt), and on seeded tandem-tiny weights (labelled:
   an untrained MTP module, accept length ~1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from engine.kv_pool import KvPool, KvPoolConfig  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from engine.model import build_model  # noqa: E402
from engine.runner import DecodeInput, ModelRunner  # noqa: E402

try:  # optional: the comparison needs it (installed on the GPU machine)
    import transformers
except ImportError:  # pragma: no cover - depends on the machine
    transformers = None


def bench_config(smoke: bool) -> ModelConfig:
    """The ~490M DeepSeek-V3-style config (8 layers, 32 experts top-4; or a tiny one for --smoke)."""
    base = dataclasses.replace(ModelConfig.tiny(), vocab_size=32000, bos_token_id=0, eos_token_id=(1,),
                               num_nextn_predict_layers=0, max_position_embeddings=40000)
    if smoke:
        return dataclasses.replace(base, vocab_size=1000, max_position_embeddings=4096)
    return dataclasses.replace(
        base, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=8,
        first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=512, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=32,
        num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_models(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tmp: Path):
    """(ours, transformers model or None, parameter count): identical weights in both."""
    if transformers is None:
        model = build_model(cfg, seed=0, dtype=dtype, device=device)
        return model, None, sum(p.numel() for p in model.parameters())
    d = cfg.to_hf_dict()
    d.pop("architectures"), d.pop("model_type")
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**d))
    hf = hf.to(dtype).eval()
    hf.save_pretrained(tmp, safe_serialization=True)
    ours, _ = load_checkpoint(tmp, dtype=dtype, device=device)
    return ours, hf, sum(p.numel() for p in hf.parameters())


def bytes_per_step(cfg: ModelConfig, model: torch.nn.Module, batch: int, context: int, elem: int) -> float:
    """Weights touched plus KV latents read by one decode step (see the module docstring)."""
    expert_params = other = 0
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight" or name.startswith(
                tuple(f"model.layers.{cfg.num_hidden_layers + k}." for k in range(cfg.num_nextn_predict_layers))):
            continue
        if ".mlp.experts." in name:
            expert_params += p.numel()
        else:
            other += p.numel()
    hit = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch
    weights = (other + expert_params * hit + batch * cfg.hidden_size) * elem
    kv = batch * context * cfg.kv_dim * cfg.num_hidden_layers * elem
    return weights + kv


def row_tokens(batch: int, vocab: int) -> list[int]:
    """`batch` distinct token ids spread over the vocabulary (ids 0 and 1 left out)."""
    return [2 + (i * 7919) % (vocab - 2) for i in range(batch)]


def bench_engine(model, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, batch: int,
                 context: int, steps: int, block_size: int, graphs: bool) -> dict[str, Any]:
    """Greedy decode tokens/s of the worker's decode step (`ModelRunner.decode_step`: host plan,
    graph replay or eager batched forward, device sampling) for `batch` sequences at `context`
    cached tokens. Each row's input token is fixed, so no step syncs; the rows' tokens differ
    (`row_tokens`), so an MoE layer routes them to different experts as real traffic does (the
    same token in every row would touch only the experts of that one token)."""
    width = -(-(context + steps + 8) // block_size)
    pool = KvPool(KvPoolConfig(num_blocks=2 + batch * width, block_size=block_size,
                               num_layers=cfg.num_hidden_layers, kv_dim=cfg.kv_dim, dtype=dtype), 1, device)
    pool.kv.normal_(0.0, 0.5)  # synthetic context latents
    runner = ModelRunner(model, pool)
    mode = "plain" if not runner.fast else "eager"
    if graphs and runner.fast:
        runner.capture_graphs(batch, context + steps + 8, sizes=[batch])
        mode = "cuda-graph"
    tables = [pool.blocks.allocate(width) for _ in range(batch)]
    params = [(SamplingParams(max_tokens=1 << 20), 0)] * batch

    tokens = row_tokens(batch, cfg.vocab_size)

    def step(n: int) -> torch.Tensor:
        return runner.decode_step([DecodeInput(t, n, x) for t, x in zip(tables, tokens)], params)

    for i in range(3):  # warm-up (positions advance as in real decoding)
        step(context + i)
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        step(context + 3 + i)
    sync(device)
    dt = time.perf_counter() - t0
    del runner, pool
    return {"batch": batch, "context": context, "steps": steps, "seconds": dt,
            "tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps, "mode": mode}


def bench_plain(model, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, batch: int,
                context: int, steps: int, block_size: int) -> dict[str, Any]:
    """The engine's plain decode path (ModelRunner.decode: per-sequence attention)."""
    width = -(-(context + steps + 2) // block_size)
    pool = KvPool(KvPoolConfig(num_blocks=batch * width, block_size=block_size,
                               num_layers=cfg.num_hidden_layers, kv_dim=cfg.kv_dim, dtype=dtype), 1, device)
    pool.kv.normal_(0.0, 0.5)
    runner = ModelRunner(model, pool, fast=False)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    tokens = [3] * batch
    runner.decode([DecodeInput(t, context, 3) for t in tables])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for s in range(steps):
        logits = runner.decode([DecodeInput(t, context + 1 + s, x) for t, x in zip(tables, tokens)])
        tokens = logits.argmax(-1).tolist()
    dt = time.perf_counter() - t0
    return {"batch": batch, "context": context, "steps": steps, "seconds": dt,
            "tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps}


def bench_hf(hf, cfg: ModelConfig, device: torch.device, batch: int, context: int, new: int) -> dict[str, Any]:
    ids = torch.randint(2, cfg.vocab_size, (batch, context), device=device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    gen(2)  # warm-up
    t1, tn = gen(1), gen(new)
    return {"batch": batch, "context": context, "new_tokens": new, "tokens_per_s": batch * (new - 1) / (tn - t1),
            "seconds_1": t1, "seconds_n": tn}


def bench_mtp(spec: str, device: torch.device, ks: list[int], prompts: list[list[int]], new: int
              ) -> list[dict[str, Any]]:
    """Greedy batch-1 generation with k = 0..K drafts: accept length and tokens/s per user."""
    from engine.model_source import load_model
    from engine.spec_decode import SpecInput, accept, spec_forward
    from common.sampling_params import SamplingParams

    loaded = load_model(spec)
    model = loaded.model.to(device)
    cfg = loaded.config
    params = SamplingParams(max_tokens=new + 1, ignore_eos=True)
    out = []
    for k in ks:
        steps = emitted = tokens_out = 0
        seconds = 0.0
        texts = []
        for prompt in prompts:
            bs = 16
            pool = KvPool(KvPoolConfig(num_blocks=-(-(len(prompt) + new + k + 2) // bs) + 1, block_size=bs,
                                       num_layers=cfg.num_kv_layers, kv_dim=cfg.kv_dim), 1, device)
            runner = ModelRunner(model, pool)
            blocks = pool.blocks.allocate(pool.config.num_blocks)
            hidden = runner.prefill_chunk(blocks, prompt, 0, len(prompt), mtp=k > 0)
            tokens = prompt + [int(runner.logits(hidden).argmax())]
            h = hidden[None]
            sync(device)
            t0 = time.perf_counter()
            while len(tokens) - len(prompt) < new:
                n = len(tokens) - 1
                if k == 0:
                    logits = runner.decode([DecodeInput(blocks, n, tokens[-1])])
                    tokens.append(int(logits[0].argmax()))
                    continue
                r = h.shape[0]
                kk = min(k, new - (len(tokens) - len(prompt)) - 1)
                inp = SpecInput(blocks, n, h, tokens[n - r + 1:], kk, params, 0)
                res = spec_forward(model, pool, [inp])[0]
                acc = accept(res, params, 0)
                h = res.hidden[:len(acc)]
                tokens += [t for t, *_ in acc]
                if kk:
                    steps += 1
                    emitted += len(acc)
            sync(device)
            seconds += time.perf_counter() - t0
            tokens_out += len(tokens) - len(prompt) - 1
            texts.append(tokens[len(prompt):])
        out.append({"model": loaded.name, "k": k, "accept_length": emitted / steps if steps else 1.0,
                    "verify_steps": steps, "tokens_per_s_per_user": tokens_out / seconds,
                    "trained": spec != "tandem-tiny", "tokens": texts})
    base = out[0]["tokens"]
    for row in out:  # greedy speculative output must equal plain decoding
        row["equals_k0"] = row.pop("tokens") == base
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# bench_decode ({res['device']}, {res['config_params'] / 1e6:.0f}M params, {res['dtype']})", ""]
    lines += ["| batch | context | engine tok/s | ms/step | mode | bound tok/s | fraction of bound |",
              "|---|---|---|---|---|---|---|"]
    for r in res["engine"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} | "
                     f"{r['mode']} | {r.get('bound_tokens_per_s', 0):.0f} | {r.get('fraction_of_bound', 0):.3f} |")
    if res["plain"]:
        lines += ["", "| batch | context | plain engine path tok/s | fast path / plain |", "|---|---|---|---|"]
        for r in res["plain"]:
            lines.append(f"| {r['batch']} | {r['context']} | {r['tokens_per_s']:.1f} | {r.get('speedup', 0):.1f}x |")
    if res["transformers"]:
        lines += ["", "| batch | context | transformers generate tok/s | engine / transformers |", "|---|---|---|---|"]
        for r in res["transformers"]:
            lines.append(f"| {r['batch']} | {r['context']} | {r['tokens_per_s']:.1f} | {r.get('speedup', 0):.1f}x |")
    lines += ["", "| model | k | accept length | tokens/s per user | output == k=0 |", "|---|---|---|---|---|"]
    for r in res["mtp"]:
        label = r["model"] + ("" if r["trained"] else " (seeded weights, untrained MTP)")
        lines.append(f"| {label} | {r['k']} | {r['accept_length']:.2f} | {r['tokens_per_s_per_user']:.1f} | "
                     f"{r['equals_k0']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU test of the script)")
    p.add_argument("--out", required=True, help="JSON results; a .md table is written next to it")
    p.add_argument("--batches", default="", help="comma list (default 1,8,64,256; smoke 1,2)")
    p.add_argument("--contexts", default="", help="comma list (default 1024,32768; smoke 32,64)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth in TB/s (H200: 4.8)")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--mtp-tokens", type=int, default=0, help="tokens per MTP prompt (default 128; smoke 8)")
    p.add_argument("--mtp-only", action="store_true", help="only part 4 (MTP), at full size even on a CPU")
    p.add_argument("--skip-transformers", action="store_true", help="no transformers generate comparison")
    p.add_argument("--skip-plain", action="store_true", help="no plain engine path comparison")
    p.add_argument("--skip-mtp", action="store_true", help="no MTP part")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device (torch {torch.__version__}); "
                "run on a GPU machine, or pass --device cpu (with --smoke for a quick check)")
    smoke = args.smoke
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    elem = torch.empty((), dtype=dtype).element_size()
    batches = [int(x) for x in (args.batches or ("1,2" if smoke else "1,8,64,256")).split(",")]
    contexts = [int(x) for x in (args.contexts or ("32,64" if smoke else "1024,32768")).split(",")]
    cfg = bench_config(smoke)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "dtype": str(dtype), "config": cfg.to_hf_dict(), "hbm_tbps": args.hbm_tbps,
                           "engine": [], "plain": [], "transformers": [], "mtp": [],
                           "transformers_version": getattr(transformers, "__version__", None)}
    if args.mtp_only:
        res["config_params"] = 0
        return finish(res, args, device, smoke=False)
    with tempfile.TemporaryDirectory() as tmp:
        model, hf, n_params = make_models(cfg, device, dtype, Path(tmp))
    res["config_params"] = n_params
    block_size = 16 if smoke else 64
    for c in contexts:
        for b in batches:
            steps = 3 if smoke else (20 if c <= 4096 else 8)
            try:
                r = bench_engine(model, cfg, device, dtype, b, c, steps, block_size, not args.no_cuda_graph)
            except torch.cuda.OutOfMemoryError as exc:
                r = {"batch": b, "context": c, "tokens_per_s": 0.0, "ms_per_step": 0.0, "mode": f"OOM: {exc}"[:120]}
            bound_s = bytes_per_step(cfg, model, b, c, elem) / (args.hbm_tbps * 1e12)
            r["bound_tokens_per_s"] = b / bound_s
            r["fraction_of_bound"] = r["tokens_per_s"] / r["bound_tokens_per_s"]
            res["engine"].append(r)
            print(json.dumps(r), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    fast = {(r["batch"], r["context"]): r["tokens_per_s"] for r in res["engine"]}
    small = [b for b in batches if b <= 64]
    plain_model = build_model(cfg, seed=0, dtype=dtype, device=device)  # per-expert loop kept
    for b in [] if args.skip_plain else small:
        r = bench_plain(plain_model, cfg, device, dtype, b, contexts[0], 2 if smoke else 3, block_size)
        r["speedup"] = fast.get((b, contexts[0]), 0.0) / r["tokens_per_s"]
        res["plain"].append(r)
        print(json.dumps(r), flush=True)
    del plain_model
    if hf is not None and not args.skip_transformers:
        for b in small:
            r = bench_hf(hf, cfg, device, b, contexts[0], 4 if smoke else 17)
            r["speedup"] = fast.get((b, contexts[0]), 0.0) / r["tokens_per_s"]
            res["transformers"].append(r)
            print(json.dumps(r), flush=True)
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return finish(res, args, device, smoke)


def finish(res: dict[str, Any], args: argparse.Namespace, device: torch.device, smoke: bool) -> dict[str, Any]:
    """Part 4 (MTP), then write OUT and OUT.md."""
    from engine.model_source import load_model
    tok = load_model("tandem-shakespeare").tokenizer()
    text = (ROOT / "tests" / "data" / "shakespeare_val_slice.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    n_prompts, plen = (1, 32) if smoke else (4, 64)
    prompts = [ids[i * 400:i * 400 + plen] for i in range(n_prompts)]
    new = args.mtp_tokens or (8 if smoke else 128)
    ks = [] if args.skip_mtp else [0, 1, 2] if smoke else [0, 1, 2, 3]
    res["mtp"] = [] if not ks else bench_mtp("tandem-shakespeare", device, ks, prompts, new)
    tiny_prompts = [[(7 * i + j) % 5000 for i in range(plen)] for j in range(min(n_prompts, 2))]
    if ks:  # seeded weights: accept length ~1, so a short run
        res["mtp"] += bench_mtp("tandem-tiny", device, ks, tiny_prompts, min(new, 32))
    for r in res["mtp"]:
        print(json.dumps(r), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(res), encoding="utf-8")
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
