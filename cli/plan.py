"""`tandem plan`: DESIGN.md section 6's capacity table — KV pool, per-request KV, requests per GPU.

With no arguments it prints the seed's table (DeepSeek-R1, FP8 KV, 288 vs 192 GiB HBM at
mem_fraction_static 0.75, 40 GiB of weights per GPU, 128K + 8K tokens, EP16, practical
fractions 0.90 and 0.85). Units and formulas: engine/capacity.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from common.env import env_default, env_name
from engine.capacity import DEEPSEEK_R1, GIB, KvFootprint, Plan, PlanInputs, parse_bytes, parse_tokens, plan
from engine.capacity import format_bytes as size

KV_DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
# preset: (KV footprint, weight bytes per GPU the seed assumed)
PRESETS = {"deepseek-r1": (DEEPSEEK_R1, 40 * GIB)}


def _list(parse):
    def f(text: str) -> list:
        return [parse(x) for x in text.split(",") if x.strip()]
    return f


def _arg(p: argparse.ArgumentParser, flag: str, default: str, help: str, parse) -> None:
    # Defaults are strings parsed like the command line, so a TANDEM_* variable reads the same way.
    raw = env_default(flag, default, str)
    p.add_argument(flag, type=parse, default=parse(raw) if raw else None,
                   help=f"{help} (default {default!r}; env {env_name(flag)})")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand to the `tandem` parser."""
    p = sub.add_parser("plan", help="KV capacity table: pool, per-request KV, requests per GPU (DESIGN.md section 6)")
    _arg(p, "--preset", "deepseek-r1", "KV footprint preset when --model is not given: deepseek-r1 "
         "(kv_lora_rank 512, qk_rope_head_dim 64, 61 layers)", str)
    _arg(p, "--model", "", "take kv_lora_rank, qk_rope_head_dim and layers from this model "
         "(tandem-shakespeare, tandem-tiny, or a checkpoint folder with config.json)", str)
    _arg(p, "--hbm", "288GiB,192GiB", "device memory per GPU, one table column each (GiB binary, GB decimal; "
         "a bare number is GiB)", _list(parse_bytes))
    _arg(p, "--mem-fraction-static", "0.75", "share of device memory for weights + KV pool", float)
    _arg(p, "--weights", "", "weight bytes resident per GPU; empty: the preset's (deepseek-r1: 40GiB, the "
         "seed's), or with --model estimated from its config (routed experts split over --ep-size)",
         lambda s: parse_bytes(s) if s else None)
    _arg(p, "--weight-dtype", "bf16", "bytes per weight element for the --model estimate: fp8, bf16, fp32", str)
    _arg(p, "--input-len", "128K", "prompt tokens per request (K = 1,000; Ki = 1,024)", parse_tokens)
    _arg(p, "--output-len", "8K", "generated tokens per request", parse_tokens)
    _arg(p, "--kv-dtype", "fp8", "KV cache element type: fp8, bf16, fp16, fp32", str)
    _arg(p, "--ep-size", "16", "GPUs (expert-parallel ranks) per decode instance", int)
    _arg(p, "--practical-fraction", "0.90,0.85", "share of the theoretical cap to run at: one value, or one "
         "per --hbm column", _list(float))
    _arg(p, "--format", "text", "text | markdown | json", str)
    p.set_defaults(func=main)


def _footprint(args: argparse.Namespace) -> tuple[str, KvFootprint, int]:
    """(model label, KV footprint, default weight bytes per GPU)."""
    if args.kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"--kv-dtype {args.kv_dtype!r}: choose one of {', '.join(KV_DTYPE_BYTES)}")
    elem = KV_DTYPE_BYTES[args.kv_dtype]
    if not args.model:
        if args.preset not in PRESETS:
            raise ValueError(f"--preset {args.preset!r}: choose one of {', '.join(PRESETS)}")
        fp, weights = PRESETS[args.preset]
        return args.preset, KvFootprint(fp.kv_lora_rank, fp.qk_rope_head_dim, fp.num_layers, elem), weights
    from engine.model_source import load_config
    name, cfg, _ = load_config(args.model)
    # The pool caches the main layers' latent (engine/worker_host.py sizes it with num_hidden_layers).
    fp = KvFootprint(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers, elem)
    return name, fp, _weights_per_gpu(cfg, args.ep_size, args.weight_dtype)


def _weights_per_gpu(cfg, ep_size: int, weight_dtype: str) -> int:
    """Parameter bytes per GPU: everything but the routed experts, plus 1/ep_size of those."""
    import torch

    from engine.model import DeepseekV3ForCausalLM
    if weight_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"--weight-dtype {weight_dtype!r}: choose one of {', '.join(KV_DTYPE_BYTES)}")
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, device="meta")  # shapes only, no memory
    experts = dense = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    return int((dense + experts / ep_size) * KV_DTYPE_BYTES[weight_dtype])


def table(label: str, fp: KvFootprint, plans: list[Plan]) -> list[tuple[str, list[str]]]:
    """Rows (name, one cell per column) of the capacity table."""
    ep = plans[0].inputs.ep_size
    return [
        ("HBM per GPU", [size(p.inputs.hbm_bytes) for p in plans]),
        ("mem_fraction_static", [f"{p.inputs.mem_fraction_static:g}" for p in plans]),
        ("weights per GPU", [size(p.inputs.weight_bytes) for p in plans]),
        ("KV pool per GPU", [size(p.pool_bytes) for p in plans]),
        ("KV bytes per token", [f"{p.inputs.bytes_per_token:,} B" for p in plans]),
        ("cached tokens per request", [f"{p.inputs.cached_tokens:,}" for p in plans]),
        ("KV per request", [size(p.per_request_bytes) for p in plans]),
        ("theoretical cap per GPU", [f"{p.theoretical_per_gpu:.2f}" for p in plans]),
        ("practical fraction", [f"{p.inputs.practical_fraction:.0%}" for p in plans]),
        ("practical per GPU", [f"{p.practical_per_gpu}" for p in plans]),
        (f"practical over EP{ep}", [f"{p.practical_total}" for p in plans]),
    ]


def render(rows: list[tuple[str, list[str]]], title: str, fmt: str) -> str:
    """The table as aligned text or markdown; columns are headed by their HBM (the first row)."""
    ncol = len(rows[0][1])
    head = ["", *[f"{cell} GPU" for cell in rows[0][1]]]
    if fmt == "markdown":
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|---" + "|--:" * ncol + "|"]
        lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
        return "\n".join(lines)
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(head[i + 1]), *(len(r[1][i]) for r in rows)) for i in range(ncol)]
    lines = [title, "  ".join([" " * w0, *(h.rjust(w) for h, w in zip(head[1:], widths))])]
    lines += ["  ".join([name.ljust(w0), *(c.rjust(w) for c, w in zip(cells, widths))]) for name, cells in rows]
    return "\n".join(lines)


def build_plans(args: argparse.Namespace) -> tuple[str, KvFootprint, list[Plan]]:
    label, fp, default_weights = _footprint(args)
    weights = args.weights if args.weights is not None else default_weights
    fractions = args.practical_fraction
    if len(fractions) == 1:
        fractions = fractions * len(args.hbm)
    if len(fractions) != len(args.hbm):
        raise ValueError(f"--practical-fraction: give one value or one per --hbm column ({len(args.hbm)})")
    cached = args.input_len + args.output_len
    plans = [plan(PlanInputs(hbm, args.mem_fraction_static, weights, cached, fp.bytes_per_token, args.ep_size, f))
             for hbm, f in zip(args.hbm, fractions)]
    return label, fp, plans


def main(args: argparse.Namespace) -> int:
    if args.format not in ("text", "markdown", "json"):
        raise ValueError(f"--format {args.format!r}: choose text, markdown or json")
    label, fp, plans = build_plans(args)
    if args.format == "json":
        print(json.dumps({"model": label, "footprint": asdict(fp),
                          "columns": [{**asdict(p.inputs), **{k: v for k, v in asdict(p).items() if k != "inputs"}}
                                      for p in plans]}, indent=2))
        return 0
    title = (f"{label}: ({fp.kv_lora_rank} + {fp.qk_rope_head_dim}) × {fp.num_layers} layers × "
             f"{fp.bytes_per_element:g} B ({args.kv_dtype}) = {fp.bytes_per_token:,} B per token; "
             f"{args.input_len:,} + {args.output_len:,} tokens per request; EP{args.ep_size}")
    print(render(table(label, fp, plans), title, args.format))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["plan", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
