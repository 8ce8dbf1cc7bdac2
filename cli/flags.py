"""argparse flags built from the options dataclasses, each defaulting to its TANDEM_* variable."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from common.env import env_default, env_name

T = TypeVar("T")

HELP = {
    "model": "served model: 'tandem-shakespeare' (shipped, trained), 'tandem-tiny' (seeded) or a Hugging Face checkpoint folder",
    "seed": "weight seed of tandem-tiny",
    "block_size": "tokens per KV block (router and workers must agree)",
    "num_blocks": "KV pool capacity in blocks",
    "chunk_size": "prefill chunk size in tokens",
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
    "ep_size": "decode: expert-parallel ranks (processes) forming this worker; 1 = no expert parallelism",
    "ep_backend": "decode: EP all-to-all backend: auto (DeepEP when it imports and ranks are on GPUs, else "
                  "torch.distributed), torch, or deepep (fails unless it can run)",
    "ep_placement": "decode: JSON file placing experts (and redundant copies of hot ones) on EP ranks, as "
                    "written by tools/bench_ep.py --plan-out; empty = expert e on rank e // (experts / ep-size)",
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
        value = env_default(flag, default, kind)
        parser.add_argument(flag, dest=f.name, type=kind, default=value,
                            help=f"{HELP.get(f.name, f.name)} (default {default!r}; env {env_name(flag)})")


def build(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Construct cls from parsed args; a bad value exits with the flag named."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as exc:
        raise SystemExit(f"tandem: {exc}") from None
