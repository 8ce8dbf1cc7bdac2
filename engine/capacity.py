"""KV capacity arithmetic: the pool a GPU can hold and how many requests fit in it.

The formulas of the seed's capacity table (docs/bench/capacity.md):

    KV pool budget      = HBM × mem_fraction_static − weight bytes
    bytes per token     = (kv_lora_rank + qk_rope_head_dim) × layers × KV bytes per element
    per-request KV      = cached tokens per request × bytes per token
    theoretical cap     = pool budget / per-request KV        (requests per GPU)
    practical per GPU   = round(practical fraction × theoretical cap)
    over EP             = practical per GPU × EP size

Unit conventions (the only simple ones under which the seed's figures all come out):
- Bytes of memory are binary: the seed's "288 GB", "192 GB", "40 GB" and the pools "176 vs 104
  GB" are GiB (2**30 bytes) — HBM is built from binary stacks (8 × 36 GiB = 288 GiB) — and the
  per-request "4.45 GiB" is GiB too. With decimal GB the caps would be 36.8 and 21.8, not ≈ 40 and ≈ 24.
- Token counts are decimal: "136K" cached tokens = 128K in + 8K out = 136,000 tokens, so one
  request holds 136,000 × 35,136 B = 4,778,496,000 B = 4.45 GiB (136 × 1024 tokens would give 4.56 GiB).
- The theoretical cap is a real number: 176 / 4.45 = 39.55 (the seed's "≈ 40") and
  104 / 4.45 = 23.37 (the seed's "≈ 24" is rounded up; it holds 23 whole requests).
- The practical count rounds to the nearest whole request: 0.90 × 39.55 = 35.6 → 36 and
  0.85 × 23.37 = 19.9 → 20, i.e. the seed's 36 and 20 (576 and 320 over EP16). The practical
  fraction is a parameter: the seed ran ~90 % of the cap on one GPU and ~85 % on the other.

The same formula sizes a worker's pool from `--mem-fraction-static` (`pool_blocks_from_memory`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

GIB = 2**30
GB = 10**9

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(k|ki|m|mi)?\s*$", re.IGNORECASE)
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str, default_unit: int = GIB) -> int:
    """'288GiB' / '288 GB' / '40e9'-free forms → bytes.

    'GiB', 'MiB', ... are binary (2**30, 2**20, ...); 'GB', 'MB', ... decimal (10**9, ...);
    'B' bytes; a bare number is in `default_unit` (GiB unless given).
    Raises:
        ValueError: not a size (the message quotes it).
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 288GiB, 141GB, 1073741824B)")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if not unit:
        scale = default_unit
    elif unit == "b":
        scale = 1
    else:
        scale = (_BINARY if "i" in unit else _DECIMAL)[unit[0]]
    return int(round(value * scale))


def format_bytes(n: float) -> str:
    """Bytes in GiB (MiB, KiB below one), about three significant digits: 176 GiB, 58.5 GiB, 4.45 GiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale or unit == "KiB":
            v = n / scale
            return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.1f} {unit}" if abs(v) >= 10 else f"{v:.2f} {unit}"
    raise AssertionError("unreachable")


def parse_tokens(text: str) -> int:
    """'136K' → 136,000 tokens (K = 1,000, the seed's convention); '128Ki' → 131,072; '4096' → 4096.

    Raises:
        ValueError: not a token count.
    """
    m = _COUNT.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a token count (examples: 136K, 128Ki, 4096)")
    unit = (m.group(2) or "").lower()
    scale = 1 if not unit else (_BINARY if unit.endswith("i") else _DECIMAL)[unit[0]]
    return int(round(float(m.group(1)) * scale))


@dataclass(frozen=True)
class KvFootprint:
    """What one cached token costs: (kv_lora_rank + qk_rope_head_dim) × layers × bytes per element."""

    kv_lora_rank: int  # MLA latent width (elements)
    qk_rope_head_dim: int  # rotary key width (elements)
    num_layers: int  # layers whose KV is cached
    bytes_per_element: float  # 1 for FP8, 2 for BF16, 4 for float32

    @property
    def bytes_per_token(self) -> int:
        return int((self.kv_lora_rank + self.qk_rope_head_dim) * self.num_layers * self.bytes_per_element)


DEEPSEEK_R1 = KvFootprint(kv_lora_rank=512, qk_rope_head_dim=64, num_layers=61, bytes_per_element=1)
"""DeepSeek-R1 with an FP8 KV cache: (512 + 64) × 61 × 1 = 35,136 B per token."""


@dataclass(frozen=True)
class PlanInputs:
    """One column of the capacity table (one kind of GPU)."""

    hbm_bytes: int  # device memory per GPU
    mem_fraction_static: float  # share of device memory for weights + KV pool, in (0, 1]
    weight_bytes: int  # model weights resident per GPU
    cached_tokens: int  # KV tokens one request holds at its longest (input + output length)
    bytes_per_token: int  # KV bytes per cached token
    ep_size: int = 1  # GPUs (expert-parallel ranks) of one decode instance
    practical_fraction: float = 0.9  # share of the theoretical cap admission aims at

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if not 0 < self.practical_fraction <= 1:
            raise ValueError(f"practical_fraction must be in (0, 1], got {self.practical_fraction}")
        for name in ("hbm_bytes", "cached_tokens", "bytes_per_token", "ep_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.weight_bytes < 0:
            raise ValueError(f"weight_bytes must be >= 0, got {self.weight_bytes}")


@dataclass(frozen=True)
class Plan:
    """The capacity table's rows for one GPU kind (bytes, requests)."""

    inputs: PlanInputs
    pool_bytes: int  # KV pool budget per GPU (may be <= 0: the weights do not leave room)
    per_request_bytes: int  # KV of one request at its longest
    theoretical_per_gpu: float  # pool / per-request (real number)
    practical_per_gpu: int  # round(practical_fraction × theoretical)
    practical_total: int  # practical_per_gpu × ep_size


def plan(inputs: PlanInputs) -> Plan:
    """The seed's capacity table for one GPU kind (formulas in the module docstring)."""
    pool = int(inputs.hbm_bytes * inputs.mem_fraction_static) - inputs.weight_bytes
    per_request = inputs.cached_tokens * inputs.bytes_per_token
    cap = max(pool, 0) / per_request
    # round half up, not Python's banker's rounding, so 20.5 requests plan as 21
    practical = math.floor(inputs.practical_fraction * cap + 0.5)
    practical = min(practical, math.floor(cap))  # never plan beyond whole requests that fit
    return Plan(inputs, pool, per_request, cap, practical, practical * inputs.ep_size)


def graph_reserve_bytes(config, max_batch: int) -> int:
    """Memory set aside from --mem-fraction-static for the decode CUDA graphs' shared pool: the
    activations of the largest captured batch (engine/graph_runner.py), estimated as float32
    logits (twice: the graph's output and its greedy head's log-softmax), the grouped experts' [B × k, 2I + hidden] rows,
    the attention's split partials (at most 32 splits of [H, kv_lora_rank] float32 at batch 1,
    fewer at larger batches: ~2 waves of SMs in all), plus 256 MiB of cuBLAS/Triton workspace.
    The worker logs the measured figure and warns when it exceeds this."""
    c = config
    per_row = (2 * c.vocab_size * 4
               + 3 * c.num_experts_per_tok * (2 * c.moe_intermediate_size + c.hidden_size) * 2
               + 3 * max(c.intermediate_size * 2, c.hidden_size) * 2
               + 16 * c.num_attention_heads * c.kv_lora_rank * 4)
    return 256 * 2**20 + max_batch * per_row + 64 * c.num_attention_heads * c.kv_lora_rank * 4


def spec_bias_reserve_bytes(config, max_batch: int, k: int) -> int:
    """What the MTP graphs' biased mode adds to their pool's peak (engine/spec_graphs.py): the
    float32 copy of the verify's logits, [max_batch · (k + 1), vocab], that a bias's scatter
    writes into (engine.sampling.adjusted; the greedy and general modes make none)."""
    return max_batch * (k + 1) * config.vocab_size * 4


def pool_blocks_from_memory(device_bytes: int, mem_fraction_static: float, weight_bytes: int,
                            block_bytes: int) -> int:
    """KV pool size in blocks: floor((device memory × mem_fraction_static − weights) / block bytes).

    Raises:
        ValueError: naming --mem-fraction-static when not even one block fits.
    """
    budget = int(device_bytes * mem_fraction_static) - weight_bytes
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(
            f"--mem-fraction-static {mem_fraction_static}: {format_bytes(device_bytes)} × {mem_fraction_static} − "
            f"{format_bytes(weight_bytes)} of weights leaves {format_bytes(budget)}, less than one KV block "
            f"of {block_bytes} B")
    return blocks


def device_memory_bytes(device: torch.device | str, override: int = 0) -> int:
    """Memory of the device the pool lives on, in bytes.

    `override` > 0 wins (`--device-memory-bytes`: tests, or a share of a shared GPU). Otherwise
    a CUDA device reports its total memory; on CPU the stand-in is the machine's physical
    memory (`os.sysconf` pages × page size).
    """
    if override > 0:
        return override
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (the weights resident on its device)."""
    tensors = list(module.parameters()) + list(module.buffers())
    seen: set[int] = set()
    total = 0
    for t in tensors:  # tied weights count once
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
