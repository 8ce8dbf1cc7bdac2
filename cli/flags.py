"""argparse flags built from the options dataclasses, each defaulting to its TANDEM_* variable."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from common.env import env_default, env_name

T = TypeVar("T")

# Older flag names kept working: field -> old flag (its TANDEM_* variable is read as well).
ALIASES = {"chunked_prefill_size": "--chunk-size"}


def _parse_bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {raw!r} (use 1/0, true/false, yes/no, on/off)")

HELP = {
    "model": "served model: 'tandem-shakespeare' (shipped, trained), 'tandem-tiny' (seeded) or a Hugging Face checkpoint folder",
    "seed": "weight seed of tandem-tiny",
    "block_size": "tokens per KV block (router and workers must agree)",
    "num_blocks": "KV pool capacity in blocks",
    "chunked_prefill_size": "prefill chunk size in tokens (the base chunk with dynamic chunking); alias --chunk-size",
    "enable_dynamic_chunking": "prefill: fit f(l) = a·l² + b·l + c from start-up timings and shrink chunks as the "
                               "prefix grows (DESIGN.md section 7); falls back to static chunks with a logged reason",
    "dynamic_chunk_smoothing": "dynamic chunking: σ in [0, 1], chunk = base + σ·(x − base)",
    "pp_size": "prefill: pipeline-parallel stage processes (1 = no pipeline)",
    "pp_layer_partition": "prefill: layers per stage, comma-separated (e.g. '3,1'); empty = as even as possible",
    "kv_cache_dtype": "KV cache storage: auto (model dtype) | bf16 | fp8_e4m3 (prefill and decode must agree)",
    "kv_cache_scale": "fp8_e4m3 KV cache: per-pool scale, stored = latent / scale",
    "device": "auto (cuda with bf16 weights when present, else cpu with float32) | cpu | cuda | cuda:N",
    "max_running": "decode: most requests in one batch",
    "host": "address to listen on",
    "port": "port to listen on (0 = any free port)",
    "etcd": "etcd endpoints host:port[,host:port]",
    "namespace": "discovery namespace in etcd",
    "lease_ttl_s": "etcd lease time to live in seconds",
    "transfer_backend": "KV transfer backend",
    "transfer_timeout_s": "KV transfer timeout in seconds",
    "health_interval_s": "router: seconds between grpc.health.v1 probes of each worker",
    "health_timeout_s": "router: seconds one health probe may take",
    "health_failure_threshold": "router: consecutive failed probes that make a worker unhealthy",
    "stall_timeout_s": "seconds one model call may run before the worker reports NOT_SERVING (wedged engine)",
    "drain_timeout_s": "on SIGTERM, seconds to let in-flight requests finish before exiting",
    "prefill_timeout_s": "decode: seconds to wait for a prefill worker (at most half the request's deadline) "
                         "before prefilling locally",
    "torch_threads": "intra-op threads for the model",
    "router_mode": "placement: kv | approx | round-robin | random | least-loaded",
    "prefill_weight": "kv/approx cost of one uncached block relative to one active decode block",
    "router_temperature": "kv/approx: 0 picks the lowest cost; > 0 samples by cost",
    "local_prefill_threshold": "prefill on the decode worker when its uncached part is below this many tokens",
    "migration_limit": "router: decode-worker failures one request may survive (retry or migrate elsewhere)",
    "approx_ttl_s": "approx mode: seconds a routed block is assumed cached",
}


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.removesuffix("_s").replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else ""
        kind = type(default)
        parse = _parse_bool if kind is bool else kind
        old = ALIASES.get(f.name)
        value = env_default(flag, env_default(old, default, parse) if old else default, parse)
        names = [flag, old] if old else [flag]
        help_text = f"{HELP.get(f.name, f.name)} (default {default!r}; env {env_name(flag)})"
        if kind is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=value,
                                help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, type=kind, default=value, help=help_text)


def build(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Construct cls from parsed args; a bad value exits with the flag named."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as exc:
        raise SystemExit(f"tandem: {exc}") from None
