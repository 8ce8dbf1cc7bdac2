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
    "router_mode": "placement: kv | approx | round-robin | random | least-loaded",
    "prefill_weight": "kv/approx cost of one uncached block relative to one active decode block",
    "router_temperature": "kv/approx: 0 picks the lowest cost; > 0 samples by cost",
    "local_prefill_threshold": "prefill on the decode worker when its uncached part is below this many tokens",
    "migration_limit": "router: decode-worker failures one request may survive (retry or migrate elsewhere)",
    "approx_ttl_s": "approx mode: seconds a routed block is assumed cached",
    "kv_recent_s": "kv mode: also count a prefix routed to a worker in the last this many seconds, before its KV "
                   "events arrive (0 = off)",
    # tandem mocker / tandem bench (mocker/fleet.py, bench/main.py)
    "num_workers": "mocker: simulated decode workers (each its own gRPC server and etcd record)",
    "num_prefill": "mocker: simulated prefill workers",
    "speedup": "simulated seconds per real second (mocker: engine time; bench: trace time, latencies scaled back)",
    "timing": "mocker: JSON timing model (mocker/timing.py fields, e.g. from python -m mocker.calibrate)",
    "tick_s": "mocker: real seconds of engine iterations per wake-up (token streaming granularity)",
    "router": "router address host:port",
    "dataset": "mooncake[:PATH] | azure:PATH | sharegpt:PATH | mt-bench[:PATH] | synthetic-prefix",
    "num_requests": "requests to send (0 = all)",
    "skip": "start at this row of the trace",
    "arrival": "trace (timestamps) | poisson (--rate) | concurrency (--concurrency in flight)",
    "rate": "poisson arrivals: requests per second of trace time",
    "concurrency": "arrival concurrency: requests in flight",
    "load": "trace arrivals: rate multiplier (2 = timestamps halved)",
    "output_len": "generated tokens where the dataset has no lengths",
    "max_output_len": "cap on generated tokens (0 = the trace's)",
    "groups": "synthetic-prefix: number of shared prefixes",
    "prefix_len": "synthetic-prefix: tokens per shared prefix",
    "suffix_len": "synthetic-prefix: fresh tokens per request",
    "bench_seed": "random seed of Poisson arrivals, synthetic prompts and Azure token ids",
    "timeout_s": "deadline of each request in seconds",
    "out": "JSON result file; plots are written beside it",
    "label": "name of the run in plots and JSON",
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
