"""`tandem plan`: the KV capacity table (docs/bench/capacity.md) — KV pool, per-request KV, requests per GPU.

With no arguments it prints the seed's table (DeepSeek-R1, FP8 KV, 288 vs 192 GiB HBM at
mem_fraction_static 0.75, 40 GiB of weights per GPU, 128K + 8K tokens, EP16, practical
fractions 0.90 and 0.85). Units and formulas: engine/capacity.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from cli.flags import add_flags, build
from engine.capacity import DEEPSEEK_R1, GIB, KvFootprint, Plan, PlanInputs, parse_bytes, parse_tokens, plan
from engine.capacity import format_bytes as size

KV_DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
# preset: (KV footprint, weight bytes per GPU the seed assumed)
PRESETS = {"deepseek-r1": (DEEPSEEK_R1, 40 * GIB)}


@dataclass(frozen=True)
class PlanOptions:
    """Flags of `tandem plan` (each has a TANDEM_* variable). Sizes and lengths are strings with
    units, parsed by engine/capacity.py; the defaults are the seed's inputs."""

    preset: str = "deepseek-r1"  # KV footprint when --model is empty
    model: str = ""  # take the KV footprint (and a weight estimate) from this model instead
    hbm: str = "288GiB,192GiB"  # device memory per GPU, one table column each
    mem_fraction_static: float = 0.75  # weights + KV pool as a share of device memory
    weights: str = ""  # weight bytes per GPU; "" = the preset's, or estimated from --model
    weight_dtype: str = "bf16"  # bytes per weight element for the --model estimate
    input_len: str = "128K"  # prompt tokens per request
    output_len: str = "8K"  # generated tokens per request
    kv_dtype: str = "fp8"  # KV cache element type
    ep_size: int = 16  # GPUs (expert-parallel ranks) per decode instance
    practical_fractions: str = "0.90,0.85"  # share of the cap to run at: one, or one per --hbm column
    format: str = "text"  # text | markdown | json

    def __post_init__(self) -> None:
        for name, allowed in (("kv_dtype", KV_DTYPE_BYTES), ("weight_dtype", KV_DTYPE_BYTES),
                              ("format", ("text", "markdown", "json"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: choose one of "
                                 f"{', '.join(allowed)}")
        if not self.model and self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        if self.ep_size < 1:
            raise ValueError(f"--ep-size must be >= 1, got {self.ep_size}")
        for name, parse in (("hbm", parse_bytes), ("weights", parse_bytes), ("input_len", parse_tokens),
                            ("output_len", parse_tokens), ("practical_fractions", float)):
            try:
                _list(parse)(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None

    @property
    def hbm_bytes(self) -> list[int]:
        return _list(parse_bytes)(self.hbm)

    @property
    def fractions(self) -> list[float]:
        return _list(float)(self.practical_fractions)


_HELP = {
    "preset": "KV footprint when --model is empty: deepseek-r1 (kv_lora_rank 512, qk_rope_head_dim 64, 61 layers)",
    "hbm": "plan: device memory per GPU, comma-separated, one table column each (GiB binary, GB decimal; a bare "
           "number is GiB)",
    "weights": "plan: weight bytes resident per GPU (e.g. 40GiB); empty: the preset's (deepseek-r1: the seed's "
               "40GiB), or with --model estimated from its config (routed experts split over --ep-size)",
    "weight_dtype": "plan: bytes per weight element for the --model estimate: fp8, bf16, fp16, fp32",
    "input_len": "plan: prompt tokens per request (K = 1,000, the seed's convention; Ki = 1,024)",
    "output_len": "plan: generated tokens per request (K = 1,000; Ki = 1,024)",
    "kv_dtype": "plan: KV cache element type: fp8, bf16, fp16, fp32",
    "ep_size": "GPUs (expert-parallel ranks) per decode instance",
    "practical_fractions": "plan: share of the theoretical cap to run at, comma-separated: one value, or one per "
                           "--hbm column",
    "mem_fraction_static": "weights + KV pool as a share of device memory",
    "format": "plan: output format: text | markdown | json",
}


def _list(parse):
    def f(text: str) -> list:
        return [parse(x) for x in text.split(",") if x.strip()]
    return f


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand to the `tandem` parser (flags from PlanOptions)."""
    p = sub.add_parser("plan", help="KV capacity table: pool, per-request KV, requests per GPU (docs/bench/capacity.md)")
    add_flags(p, PlanOptions, help=_HELP)
    p.set_defaults(func=lambda args: main(build(PlanOptions, args)))


def _footprint(opts: PlanOptions) -> tuple[str, KvFootprint, int]:
    """(model label, KV footprint, default weight bytes per GPU)."""
    elem = KV_DTYPE_BYTES[opts.kv_dtype]
    if not opts.model:
        fp, weights = PRESETS[opts.preset]
        return opts.preset, KvFootprint(fp.kv_lora_rank, fp.qk_rope_head_dim, fp.num_layers, elem), weights
    from engine.model_source import load_config
    name, cfg, _ = load_config(opts.model)
    # The pool holds every KV layer: the main layers and the MTP module's (worker/host.py, num_kv_layers).
    fp = KvFootprint(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_kv_layers, elem)
    return name, fp, _weights_per_gpu(cfg, opts.ep_size, opts.weight_dtype)


def _weights_per_gpu(cfg, ep_size: int, weight_dtype: str) -> int:
    """Parameter bytes per GPU: everything but the routed experts, plus 1/ep_size of those."""
    import torch

    from engine.model import DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, device="meta")  # shapes only, no memory
    experts = dense = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    return int((dense + experts / ep_size) * KV_DTYPE_BYTES[weight_dtype])


def _hbm(nbytes: int) -> str:
    """A column's device memory in GiB, as the table counts, and in GB where it is a whole number
    of them (a datasheet's "141GB" shows as "131 GiB (141 GB)", not as if it were 131 GB)."""
    return size(nbytes) + (f" ({nbytes // 10 ** 9:,} GB)" if nbytes % 10 ** 9 == 0 else "")


def table(label: str, fp: KvFootprint, plans: list[Plan]) -> list[tuple[str, list[str]]]:
    """Rows (name, one cell per column) of the capacity table."""
    ep = plans[0].inputs.ep_size
    return [
        ("HBM per GPU", [_hbm(p.inputs.hbm_bytes) for p in plans]),
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


def build_plans(opts: PlanOptions) -> tuple[str, KvFootprint, list[Plan]]:
    """(model label, KV footprint, one Plan per --hbm column).

    Raises:
        ValueError: naming the flag (a column count mismatch, a bad size or fraction).
    """
    label, fp, default_weights = _footprint(opts)
    weights = parse_bytes(opts.weights) if opts.weights else default_weights
    hbm, fractions = opts.hbm_bytes, opts.fractions
    if opts.practical_fractions == PlanOptions.practical_fractions and len(hbm) != len(fractions):
        fractions = fractions[:1]  # the default pair is the seed's two columns; one column takes the first
    if len(fractions) == 1:
        fractions = fractions * len(hbm)
    if len(fractions) != len(hbm):
        raise ValueError(f"--practical-fractions: give one value or one per --hbm column ({len(hbm)})")
    cached = parse_tokens(opts.input_len) + parse_tokens(opts.output_len)
    plans = [plan(PlanInputs(h, opts.mem_fraction_static, weights, cached, fp.bytes_per_token, opts.ep_size, f))
             for h, f in zip(hbm, fractions)]
    for p in plans:
        if p.pool_bytes <= 0:
            raise ValueError(f"--hbm {size(p.inputs.hbm_bytes)}: × --mem-fraction-static "
                             f"{opts.mem_fraction_static} leaves no KV pool after {size(weights)} of weights "
                             "(--weights)")
    return label, fp, plans


def _layers(opts: PlanOptions) -> str:
    """"layers", or for a --model with an MTP module "KV layers (N + k MTP)": the pool holds the
    MTP layers' KV too, so the count is more than the model's own layers."""
    if not opts.model:
        return "layers"
    from engine.model_source import load_config
    _, cfg, _ = load_config(opts.model)
    mtp = cfg.num_kv_layers - cfg.num_hidden_layers
    return f"KV layers ({cfg.num_hidden_layers} + {mtp} MTP)" if mtp else "layers"


def context_note(opts: PlanOptions) -> str | None:
    """A warning when --model's context (its config's max_position_embeddings) is shorter than
    --input-len + --output-len: its workers would refuse such requests; None otherwise."""
    if not opts.model:
        return None
    from engine.model_source import load_config
    name, cfg, _ = load_config(opts.model)
    prompt = parse_tokens(opts.input_len)
    want = prompt + parse_tokens(opts.output_len)
    if want <= cfg.max_position_embeddings and prompt < cfg.max_position_embeddings:
        return None  # (a prompt of the whole context leaves no room for a token: refused too)
    return (f"note: {want:,} tokens per request (--input-len + --output-len) exceed {name}'s context of "
            f"{cfg.max_position_embeddings:,} tokens; its workers refuse such requests")


def main(opts: PlanOptions) -> int:
    """Print the table (`opts.format`), and on stderr a note when the requests exceed --model's
    context; 0 on success."""
    label, fp, plans = build_plans(opts)
    if (note := context_note(opts)) is not None:
        print(note, file=sys.stderr)
    if opts.format == "json":
        print(json.dumps({"model": label, "footprint": asdict(fp),
                          "columns": [{**asdict(p.inputs), **{k: v for k, v in asdict(p).items() if k != "inputs"}}
                                      for p in plans]}, indent=2))
        return 0
    cached_in, cached_out = parse_tokens(opts.input_len), parse_tokens(opts.output_len)
    title = (f"{label}: ({fp.kv_lora_rank} + {fp.qk_rope_head_dim}) × {fp.num_layers} {_layers(opts)} × "
             f"{fp.bytes_per_element:g} B ({opts.kv_dtype}) = {fp.bytes_per_token:,} B per token; "
             f"{cached_in:,} + {cached_out:,} tokens per request; EP{opts.ep_size}")
    print(render(table(label, fp, plans), title, opts.format))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["plan", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
