"""Options of every subcommand: argparse flags built from the options dataclasses (or declared
one by one with `add_option`), each with a TANDEM_* variable and a key in the TOML config file.

Flags are registered with no argparse default (argparse.SUPPRESS), so that after parsing a flag
is present in the namespace only when it was given; cli/config.py then fills in the others
(precedence: flag > env > file > default) and records where each value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Collection
from typing import Any, Callable, TypeVar

from common.env import env_name, parse_bool

T = TypeVar("T")

# Other spellings of a flag: field -> extra flags (SGLang's name for our --chunk-size).
ALIASES = {"chunk_size": ("--chunked-prefill-size",)}

HELP = {
    "model": "served model: 'tandem-shakespeare' (shipped, trained), 'tandem-tiny' (seeded) or a Hugging Face checkpoint folder",
    "seed": "weight seed of tandem-tiny",
    "block_size": "tokens per KV block (router and workers must agree)",
    "num_blocks": "KV pool capacity in blocks (0 = from --mem-fraction-static, else 4096); wins over "
                  "--mem-fraction-static",
    "mem_fraction_static": "weights + KV pool as a share of device memory; sizes the pool when --num-blocks is 0 "
                           "(0 = off)",
    "device_memory_bytes": "device memory for --mem-fraction-static in bytes (0 = the GPU's total; on CPU the "
                           "machine's physical memory)",
    "practical_fraction": "decode admission: admit while the admitted requests' KV at prompt + max_tokens fits "
                          "this share of the pool (> 1 overcommits; retraction recovers)",
    "max_queued": "decode: requests that may wait for admission; beyond it RESOURCE_EXHAUSTED",
    "solo_wait_s": "decode: seconds a request whose prompt + max_tokens exceeds the admission budget (so it runs "
                   "only alone) may wait for the worker to be free before RESOURCE_EXHAUSTED; also its turn once "
                   "running, after which it is retracted if requests wait behind it (it resumes later)",
    "stream_interval": "decode: a running request's generated tokens are streamed in messages of this many (the "
                       "first token and the last message go at once); at high concurrency on a GPU, 2-8 cut the "
                       "per-token messages the worker, the router and the client handle, for burstier streams "
                       "(SGLang's --stream-interval)",
    "gil_switch_interval_us": "microseconds a thread of the worker may hold the GIL while another waits for it "
                              "(sys.setswitchinterval): the model thread and the event loop hand it to each other "
                              "many times per decode step, and at Python's default 5,000 a woken thread can wait "
                              "longer than a whole step on a GPU; 1 to 5000",
    "gc_freeze": "just before the process starts serving (a worker: model, CUDA graphs and warm-up done), "
                 "collect once and gc.freeze() what is alive, so that later full collections walk only what "
                 "requests allocated since, not the whole start-up heap (~70 ms a collection for the imports "
                 "alone; every thread waits meanwhile, decode steps too); --no-gc-freeze to compare",
    "chunk_size": "prefill chunk size in tokens (the base chunk with dynamic chunking); 0 = 8192 on a GPU, 256 on CPU; alias --chunked-prefill-size",
    "max_prefill_tokens": "token budget of one prefill forward (a prefill worker's, or a decode worker's local "
                          "prefills); the next chunks of concurrent prompts "
                          "are packed into it first come first served (a chunk larger than the budget runs alone). "
                          "16384 as SGLang's default: large enough that a forward keeps a GPU busy, small enough "
                          "to bound its activation memory and the wait of a chunk behind it",
    "prefill_tokens_per_decode_step": "decode: while requests decode, a local prefill (no prefill worker, or a "
                                      "re-prefill after retraction) runs at most this many prompt tokens between "
                                      "two decode steps (N times as many between two launches of "
                                      "--decode-steps-per-launch N), so the running streams' inter-token latency "
                                      "stays about one step plus one piece; with nothing decoding chunks run whole; "
                                      "0 = off",
    "prefill_sm_count": "decode on CUDA: run the local prefill (prompts without a prefill worker, re-prefills) "
                        "on a CUDA green context of this many SMs, so the decode steps keep the others whatever "
                        "the prefill runs (kernels of one context otherwise hold SMs the step's short kernels wait "
                        "for); the driver may round it; 0 = one stream sharing all SMs",
    "enable_dynamic_chunking": "prefill: fit f(l) = a·l² + b·l + c from start-up timings and shrink chunks as the "
                               "prefix grows; falls back to static chunks with a logged reason",
    "dynamic_chunk_smoothing": "dynamic chunking: σ in [0, 1], chunk = base + σ·(x − base)",
    "pp_size": "prefill: pipeline-parallel stage processes (1 = no pipeline)",
    "pp_layer_partition": "prefill: layers per stage, comma-separated (e.g. '3,1'); empty = as even as possible",
    "kv_cache_dtype": "KV cache storage: auto (model dtype) | bf16 | fp8_e4m3 (prefill and decode must agree)",
    "kv_cache_scale": "fp8_e4m3 KV cache: per-pool scale, stored = latent / scale",
    "device": "auto (cuda with bf16 weights when present, else cpu with float32) | cpu | cuda | cuda:N",
    "max_running": "decode: most requests in one batch",
    "host": "address to listen on",
    "port": "port to listen on (0 = any free port)",
    "advertise_host": "host or IP other processes reach this one at, registered in etcd (default: --host; "
                      "with --host 0.0.0.0 the hostname's address, e.g. a container's IP)",
    "etcd": "etcd endpoints host:port[,host:port]",
    "namespace": "discovery namespace in etcd",
    "lease_ttl_s": "etcd lease time to live in seconds",
    "transfer_backend": "KV transfer backend: auto (per peer: cuda-ipc for GPU pools on one host, shm for host "
                        "pools on one host, else nixl) | nixl | shm | cuda-ipc",
    "transfer_timeout_s": "KV transfer timeout in seconds",
    "health_interval_s": "router: seconds between grpc.health.v1 probes of each worker",
    "health_timeout_s": "router: seconds one health probe may take",
    "health_failure_threshold": "router: consecutive failed probes that make a worker unhealthy",
    "stall_timeout_s": "seconds one model call may run before the worker reports NOT_SERVING (wedged engine)",
    "drain_timeout_s": "on SIGTERM, seconds to let in-flight requests finish before exiting",
    "prefill_timeout_s": "decode: seconds to wait for a prefill worker (at most half the request's deadline) "
                         "before prefilling locally",
    "torch_threads": "intra-op threads for the model",
    "speculative_num_steps": "decode: MTP draft tokens per verify step (0 = no speculative decoding); "
                             "output equals k = 0's; with the overlap scheduler the accept lengths stay "
                             "on the GPU",
    "decode_steps_per_launch": "decode on a GPU, overlap scheduler without MTP: decode steps queued back to back "
                               "per model-thread call (1..4). N pays the per-step host work (hand-over, scheduling, "
                               "streaming) once per N steps, which matters where the host sets the pace (many "
                               "short steps: a small model at high concurrency); new requests then join up to "
                               "N - 1 steps later, a request ending at the first step of a launch still takes a row "
                               "in its later steps and in the launch queued behind it (up to 2N - 1 dropped rows), "
                               "and tokens reach the stream N steps at a time. 1 = a launch and a stream message "
                               "per step. Tokens are those of 1 for the same batches (bf16 rows may differ where "
                               "the batches do)",
    "disable_overlap_schedule": "decode: turn the overlap scheduler off, with or without MTP (it runs on "
                                "CUDA only; on a CPU steps always run in turn)",
    "disable_cuda_graph": "decode on CUDA: run every step eagerly instead of replaying the decode step's "
                          "CUDA graph (captured at start-up for batch sizes up to --max-running)",
    "ep_size": "decode: expert-parallel ranks (processes) forming this worker; 1 = no expert parallelism; "
               "from --device cuda:i, rank r runs on GPU i + r",
    "ep_backend": "decode: EP all-to-all backend: auto (DeepEP when it imports and ranks are on GPUs, else "
                  "torch.distributed), torch, or deepep (fails unless it can run)",
    "ep_placement": "decode: JSON file placing experts (and redundant copies of hot ones) on EP ranks, as "
                    "written by tools/bench_ep.py --plan-out; empty = expert e on rank e // (experts / ep-size)",
    "router_mode": "placement: kv | approx | round-robin | random | least-loaded",
    "load_reports": "kv/approx: score workers on the load they report (requests, KV blocks held, prompt tokens "
                    "not yet prefilled; KvEventService.WatchLoad) plus what this router placed since, so several "
                    "routers share one view; off: each router counts only what it placed itself",
    "load_report_interval_s": "seconds between a worker's load reports (--load-reports): each router gets one "
                              "message per worker per interval while its load changes; a fleet of 1,000 workers "
                              "wants about 1 s",
    "prefill_weight": "kv/approx cost of one uncached block relative to one active decode block; 0 = derived from "
                      "the workers' announced prefill and decode timings and the mean output length (docs/routing.md)",
    "router_temperature": "kv/approx: 0 picks the lowest cost; > 0 samples by cost",
    "local_prefill_threshold": "prefill on the decode worker when its uncached part is below this many tokens",
    "migration_limit": "router: decode-worker failures one request may survive (retry or migrate elsewhere)",
    "default_deadline_s": "router: deadline in seconds of router → worker calls when the client sets none",
    "token_stall_timeout_s": "router: floor in seconds of the stall timeout: a running stream silent for "
                             "max(this, --token-stall-itl-factor × its worker's observed ITL × tokens per message) "
                             "counts its worker as failed and the request migrates (0 = off)",
    "token_stall_itl_factor": "router: N of the stall timeout's N × the worker's observed inter-token latency "
                              "× the tokens its messages carry (EWMAs over its streams; 0 = the floor alone)",
    "keepalive_time_s": "router: seconds between HTTP/2 keepalive PINGs on each channel to a worker (>= 1)",
    "keepalive_timeout_s": "router: seconds a keepalive PING may go unanswered before the channel's calls fail "
                           "(a stopped or unreachable worker)",
    "approx_ttl_s": "approx mode: seconds a routed block is assumed cached",
    "reuse_port": "router: share --port and --http-port with other router processes of this host "
                  "(SO_REUSEPORT; the kernel spreads clients' connections over them; each places on the "
                  "load the workers report, so they place alike); `tandem up --routers N` starts N so",
    "http_port": "router: OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, "
                 "/health, /metrics; -1 = off, 0 = any free port, announced in discovery)",
    "http_host": "router: address the HTTP API listens on (e.g. 127.0.0.1 behind a TLS proxy while gRPC listens "
                 "on --host); empty = --host",
    "http_tls_cert": "router: PEM certificate (chain) for the HTTP API, which then serves HTTPS; with "
                     "--http-tls-key; empty = plain HTTP (any certificate clients trust, not necessarily the "
                     "cluster CA's)",
    "http_tls_key": "router: PEM private key of --http-tls-cert",
    "metrics_port": "Prometheus /metrics port (-1 = off, 0 = any free port, announced in discovery)",
    "kv_recent_s": "kv mode: also count a prefix routed to a worker in the last this many seconds, before its KV "
                   "events arrive (0 = off)",
    "tls_cert": "PEM certificate of this process, issued by the cluster CA and naming its role "
                "(docs/security.md); with --tls-key and --tls-ca; none of the three = plaintext",
    "tls_key": "PEM private key of --tls-cert",
    "tls_ca": "PEM certificate of the cluster CA; peers' certificates must chain to it",
    "api_keys": "router: TOML or JSON file of API keys (key -> tenant, admin, cache_group; docs/security.md): "
                "clients must send `authorization: Bearer <key>`, tenants get separate prefix caches; "
                "SIGHUP reloads it; empty = an open front",
    # tandem mocker / tandem bench (mocker/fleet.py, bench/main.py)
    "num_workers": "mocker: simulated decode workers (each its own gRPC server and etcd record)",
    "num_prefill": "mocker: simulated prefill workers",
    "speedup": "simulated seconds per real second (mocker: engine time; bench: trace time, latencies scaled back)",
    "timing": "mocker: JSON timing model (mocker/timing.py fields, e.g. from python -m mocker.calibrate)",
    "tick_s": "mocker: real seconds of engine iterations per wake-up (token streaming granularity)",
    "router": "router address host:port",
    "router_wait_s": "bench: seconds to wait for the router to answer and its set of decode workers to settle "
                     "before the first request (a `tandem up` started just before); 0 = fail at once",
    "backend": "bench: grpc (FrontendService.Generate at --router) or openai (POST /v1/completions at --http-url; "
               "the model and its workers are still read from --router)",
    "http_url": "bench --backend openai: base URL of the router's OpenAI-compatible HTTP API (default: where "
                "the router at --router says it serves it)",
    "http_ca": "bench --backend openai over https://: a CA certificate file the API's certificate may chain to, "
               "besides the system's and --tls-ca's (a router whose HTTP API has a certificate of another CA "
               "than its gRPC port)",
    "dataset": "mooncake[:PATH] | azure:PATH | sharegpt:PATH | mt-bench[:PATH] | synthetic-prefix",
    "num_requests": "requests to send (0 = all)",
    "skip": "start at this row of the trace",
    "arrival": "trace (timestamps) | poisson (--rate) | concurrency (--concurrency in flight)",
    "rate": "poisson arrivals: requests per second of trace time",
    "concurrency": "arrival concurrency: requests in flight",
    "connections": "gRPC connections to the router, each request on the next in turn: with router replicas on "
                   "one port (tandem up --routers N) the kernel gives each connection to one of them",
    "load": "trace arrivals: rate multiplier (2 = timestamps halved)",
    "output_tokens": "bench: generated tokens where the dataset has no lengths",
    "profile_dir": "write a torch.profiler trace (Chrome format, .json.gz) of a window of this worker's model calls "
                   "here, with a summary of each CUDA stream's busy and idle time and its longest gaps; \"\" = off",
    "profile_calls": "with --profile-dir: SKIP:COUNT, the model calls to skip once serving, then the ones to "
                     "record (a decode worker's call is a launch of up to --decode-steps-per-launch steps; with "
                     "MTP a step's launch or collect)",
    "max_output_len": "cap on generated tokens (0 = the trace's)",
    "over_context": "requests whose prompt + output exceed the model's context: skip (left out before the run, "
                    "counted on stderr) or send (each refused with INVALID_ARGUMENT)",
    "groups": "synthetic-prefix: number of shared prefixes",
    "prefix_len": "synthetic-prefix: tokens per shared prefix",
    "suffix_len": "synthetic-prefix: fresh tokens per request",
    "bench_seed": "random seed of Poisson arrivals, synthetic prompts and Azure token ids; with --temperature, "
                  "request i samples with seed bench_seed + i",
    "temperature": "bench: every request's sampling temperature (0 = greedy)",
    "top_logprobs": "bench: every generated token's k likeliest alternatives are asked for too (0-20; 0 = none)",
    "timeout_s": "deadline of each request in seconds",
    "out": "JSON result file; plots are written beside it",
    "label": "name of the run in plots and JSON",
    "api_key": "API key sent as `authorization: Bearer <key>` to a router started with --api-keys",
}


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of one subcommand.

    name is the dataclass field, the argparse dest and the TOML key (e.g. "drain_timeout_s");
    flag the command-line spelling ("--drain-timeout"); env its variable ("TANDEM_DRAIN_TIMEOUT");
    kind one of int, float, str, bool, list (a list of strings, e.g. --stop).
    """

    name: str
    flag: str
    env: str
    default: Any
    kind: type
    help: str
    aliases: tuple[str, ...] = ()  # other flag spellings (ALIASES)


ATTR = "tandem_options"  # where a parser keeps its list of Option


# Worker options of one role only, which the other role's parser leaves out: their TANDEM_*
# variables and [worker] or top-level file keys then reach only the role they apply to (one
# environment or file serves `tandem up`'s every process); the other role's flag is refused by name.
# Per worker role, the options only the other role has, each with the value that means "what
# this role runs anyway" (accepted, so scripts passing it to every worker work) or None.
OTHER_ROLE_ONLY: dict[str, dict[str, str | None]] = {
    "prefill": {"ep_size": "1", "ep_backend": None, "ep_placement": None},  # expert parallelism: decode
    "decode": {"pp_size": "1", "pp_layer_partition": None},  # pipeline parallelism: prefill
}


class _OtherRole(argparse.Action):
    """A flag of the other worker role: refused with `message` (argparse's usage error, status 2),
    unless it is given `harmless`."""

    def __init__(self, *args, message: str, harmless: str | None, **kw) -> None:
        super().__init__(*args, **kw)
        self.message, self.harmless = message, harmless

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.harmless is None or values != self.harmless:
            parser.error(self.message)


def refuse_other_role(parser: argparse.ArgumentParser, role: str) -> None:
    """Hidden flags on `role`'s parser (prefill or decode) for the other role's OTHER_ROLE_ONLY
    options: named in a clear error rather than argparse's "unrecognized arguments"."""
    other = "decode" if role == "prefill" else "prefill"
    for name, harmless in OTHER_ROLE_ONLY[role].items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, nargs="?", help=argparse.SUPPRESS, default=argparse.SUPPRESS, action=_OtherRole,
                            message=f"{flag} applies to {other} workers only (tandem {other})", harmless=harmless)


def options_of(parser: argparse.ArgumentParser) -> list[Option]:
    return getattr(parser, ATTR, [])


def add_argument(parser: argparse.ArgumentParser, opt: Option) -> None:
    """The argparse flag of `opt`, with no default (given flags only; see the module docstring)."""
    shown = f"{opt.help} (default {opt.default!r}; env {opt.env})"
    if opt.kind is bool:
        parser.add_argument(opt.flag, *opt.aliases, dest=opt.name, action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=shown)
    elif opt.kind is list:
        parser.add_argument(opt.flag, *opt.aliases, dest=opt.name, action="append", default=argparse.SUPPRESS,
                            help=shown + "; repeatable")
    else:
        parser.add_argument(opt.flag, *opt.aliases, dest=opt.name, type=opt.kind, default=argparse.SUPPRESS,
                            help=shown)


def add_option(parser: argparse.ArgumentParser, flag: str, default: Any, help: str, kind: type | None = None,
               env: str | None = None, name: str | None = None, aliases: tuple[str, ...] = ()) -> None:
    """Declare one option not backed by a dataclass (e.g. `tandem up --prefill`).

    kind defaults to the type of `default` (str when the default is None); env to
    TANDEM_<FLAG>; name (dest and TOML key) to the flag with dashes as underscores.
    """
    kind = kind or (type(default) if default is not None else str)
    opt = Option(name or flag.lstrip("-").replace("-", "_"), flag, env or env_name(flag), default, kind, help,
                 tuple(aliases))
    if not hasattr(parser, ATTR):
        setattr(parser, ATTR, [])
    options_of(parser).append(opt)
    add_argument(parser, opt)


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: Collection[str] = (),
              help: dict[str, str] | None = None) -> None:
    """One option per field of the options dataclass `cls` (except `skip`); a field without a
    default (a required one, such as the router's etcd) shows as an empty string. `help`
    overrides HELP for this parser (e.g. `tandem plan`'s --ep-size is not a worker's)."""
    texts = {**HELP, **(help or {})}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.removesuffix("_s").replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else ""
        add_option(parser, flag, default, texts.get(f.name, f.name), kind=type(default), name=f.name,
                   aliases=ALIASES.get(f.name, ()))


def parser_for(kind: type) -> Callable[[str], Any]:
    """How a TANDEM_* value of this kind is parsed (a list is a JSON array of strings or one string)."""
    if kind is bool:
        return parse_bool
    if kind is list:
        return _parse_list
    return kind


def _parse_list(raw: str) -> list[str]:
    import json
    if not raw.startswith("["):
        return [raw]
    value = json.loads(raw)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a JSON array of strings")
    return value



def where_from(source: str) -> str:
    kind, _, place = source.partition(" ")
    if kind == "env":
        return f"the environment variable {place}"
    path, _, key = place.rpartition(":")
    return f"{key} in the config file {path}"


def name_sources(message: str, set_by: dict[str, str]) -> str:
    """`message` with a note on where each flag it names got its value, when that was not the
    command line: an error about `--http-port` caused by TANDEM_HTTP_PORT=-5 should say so
    (`set_by` is what `apply` left in args.set_by: flag -> "env TANDEM_X" | "file PATH:key")."""
    if "came from" in message:  # the message says where already
        return message
    named = dict.fromkeys(re.findall(r"--[a-z][a-z0-9-]*", message))
    notes = [f"{flag} came from {where_from(set_by[flag])}" for flag in named if flag in set_by]
    return f"{message} ({'; '.join(notes)})" if notes else message


def construct(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """cls from parsed args. Raises ValueError: a bad value, the flag named and, where the value
    came from a TANDEM_* variable or the config file, where."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(name_sources(str(exc), getattr(args, "set_by", {}))) from None


def build(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """`construct`, for a process's own options: a bad value exits with the flag named."""
    try:
        return construct(cls, args, **overrides)
    except ValueError as exc:
        raise SystemExit(f"tandem: {exc}") from None
