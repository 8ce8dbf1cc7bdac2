"""`tandem bench`: replay a trace (or prompts) against a router and report like sglang.bench_serving.

    tandem bench --router 127.0.0.1:50051                     # the shipped Mooncake slice
    tandem bench --dataset mooncake:../shared/datasets/mooncake/conversation_trace.jsonl \\
                 --num-requests 2000 --speedup 10 --out results/run.json

Prints the result table, writes the JSON (summary + per-request records) to --out and the
plots (TTFT CDF, throughput and hit rate over time) beside it.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple, TYPE_CHECKING, Callable

from bench import traces
from bench.client import BenchSampling, LoadState, RequestResult, run_load
from bench.metrics import summarize, table
from bench.traces import BenchRequest
from common.sampling_params import MAX_TOP_LOGPROBS
from common.validation import FLOAT32_MAX, MIN_TEMPERATURE

if TYPE_CHECKING:
    from common.tls import TlsCredentials

DATASETS = ("mooncake[:PATH]", "azure:PATH", "sharegpt:PATH", "mt-bench[:PATH]", "synthetic-prefix")


@dataclass(frozen=True)
class BenchOptions:
    """Flags of `tandem bench` (each has a TANDEM_* variable)."""

    router: str = "127.0.0.1:50051"  # router address host:port
    router_wait_s: float = 180.0  # seconds to wait for the router and its workers before the first request
    backend: str = "grpc"  # grpc (FrontendService.Generate) | openai (the router's HTTP API at --http-url)
    http_url: str = ""  # --backend openai: base URL of the OpenAI-compatible API ("" = the router's own, as it says)
    http_ca: str = ""  # --backend openai over https: a CA file its certificate may chain to (besides the system's)
    dataset: str = "mooncake"  # mooncake[:PATH] | azure:PATH | sharegpt:PATH | mt-bench[:PATH] | synthetic-prefix
    num_requests: int = 0  # 0 = every request of the dataset
    skip: int = 0  # start at this row of a trace
    arrival: str = "trace"  # trace | poisson | concurrency
    rate: float = 1.0  # poisson: requests/second (trace time)
    concurrency: int = 8  # concurrency: requests in flight
    connections: int = 1  # grpc: TCP connections to the router, requests spread round-robin (router replicas)
    load: float = 1.0  # trace: arrival rate multiplier (2 = timestamps halved)
    speedup: float = 1.0  # the mocker's speedup: arrivals compressed, latencies reported ×speedup
    output_tokens: int = 128  # generated tokens for datasets without lengths (text prompts, synthetic)
    max_output_len: int = 0  # cap on generated tokens (0 = as the trace says)
    over_context: str = "skip"  # requests whose prompt + output exceed the model's context: skip (counted, not sent) | send (each refused)
    groups: int = 16  # synthetic-prefix: prefix groups
    prefix_len: int = 4096  # synthetic-prefix: shared tokens per group
    suffix_len: int = 512  # synthetic-prefix: fresh tokens per request
    bench_seed: int = 0  # random seed: Poisson arrivals, synthetic prompts, Azure token ids
    temperature: float = 0.0  # every request's sampling temperature (0 = greedy; > 0: request i seeded bench_seed + i)
    top_logprobs: int = 0  # ask for each generated token's k likeliest alternatives too (0..20)
    timeout_s: float = 600.0  # deadline of each request (real seconds)
    out: str = ""  # JSON result path; plots go beside it ("" = print only)
    label: str = ""  # name of this run in plots and JSON
    tls_ca: str = ""  # the cluster CA: the router's certificate must chain to it (TLS); "" = plaintext
    tls_cert: str = ""  # optional client certificate (with --tls-key)
    tls_key: str = ""
    api_key: str = ""  # bearer token for a router with --api-keys ("" = none)

    def __post_init__(self) -> None:
        if self.backend not in ("grpc", "openai"):
            raise ValueError(f"--backend must be grpc or openai; got {self.backend!r}")
        if self.backend == "openai" and self.http_url and not self.http_url.startswith(("http://", "https://")):
            raise ValueError(f"--http-url must start with http:// or https://; got {self.http_url!r}")
        if self.http_ca and not os.path.isfile(self.http_ca):
            raise ValueError(f"--http-ca {self.http_ca}: no such file")
        if self.arrival not in ("trace", "poisson", "concurrency"):
            raise ValueError(f"--arrival must be trace, poisson or concurrency; got {self.arrival!r}")
        if self.speedup <= 0 or self.load <= 0 or self.rate <= 0:
            raise ValueError("--speedup, --load and --rate must be > 0")
        if min(self.num_requests, self.skip, self.max_output_len) < 0 or self.output_tokens < 1 or self.concurrency < 1:
            raise ValueError("--num-requests, --skip, --max-output-len must be >= 0; --output-tokens, --concurrency >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds (each request's deadline), got {self.timeout_s}")
        # the servers' own rules (common/validation.py), so that a run is not refused request by request
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= FLOAT32_MAX):
            raise ValueError(f"--temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {FLOAT32_MAX:.8g}] (float32), "
                             f"got {self.temperature}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"--top-logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 0 <= self.bench_seed < 2 ** 64:
            raise ValueError(f"--bench-seed must be in [0, 2^64), got {self.bench_seed}")
        if self.over_context not in ("skip", "send"):
            raise ValueError(f"--over-context must be skip or send; got {self.over_context!r}")
        if self.connections < 1:
            raise ValueError(f"--connections must be >= 1, got {self.connections}")
        name = self.dataset.split(":", 1)[0]
        if name not in ("mooncake", "azure", "sharegpt", "mt-bench", "synthetic-prefix"):
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}; got {self.dataset!r}")


def load_requests(opts: BenchOptions, vocab: int) -> list[BenchRequest]:
    """The requests of --dataset with arrival times in trace seconds (before --load).

    Raises:
        ValueError: a dataset that needs a path got none, a malformed row (the dataset named),
            or no requests at all. FileNotFoundError: no such file.
    """
    return _loaded(opts, vocab).reqs


class Loaded(NamedTuple):
    """What a run sends: its requests (arrivals scaled by --load), whether they arrive as a
    Poisson process (`_load`'s decision), and how many were left out as longer than the model's
    context (`_fitting`)."""

    reqs: list[BenchRequest]
    poisson: bool
    left_out: int = 0


def _loaded(opts: BenchOptions, vocab: int, context_length: int = 0) -> Loaded:
    """`load_requests`; with the model's `context_length` (0 = unknown) under --over-context
    skip, the requests that cannot fit left out first (`_fitting`), so the others' arrivals
    are drawn or re-based as if the dataset held them alone."""
    try:
        return _load(opts, vocab, context_length)
    except (KeyError, TypeError, IndexError, json.JSONDecodeError) as exc:  # a row without the trace's fields
        raise ValueError(f"--dataset {opts.dataset}: malformed row ({type(exc).__name__}: {exc})") from None


def _load(opts: BenchOptions, vocab: int, context_length: int) -> Loaded:
    name, _, path = opts.dataset.partition(":")
    n = opts.num_requests or None
    upto = n + opts.skip if n else None  # rows read before --skip drops its first ones
    if name == "mooncake":
        reqs = traces.load_mooncake(Path(path) if path else traces.DEFAULT_TRACE, vocab, n, opts.skip)
    elif name == "synthetic-prefix":
        if opts.skip:
            raise ValueError("--skip starts at a row of a trace or prompt file; --dataset synthetic-prefix draws its "
                             "requests (change --bench-seed for others)")
        reqs = traces.synthetic_prefix(n or 1000, opts.groups, opts.prefix_len, opts.suffix_len, opts.output_tokens,
                                       vocab, opts.bench_seed)
    else:
        if name == "azure":
            reqs = traces.load_azure(Path(_need(path, name)), vocab, upto, opts.bench_seed)
        elif name == "sharegpt":
            reqs = traces.load_sharegpt(Path(_need(path, name)), opts.output_tokens, upto)
        else:
            reqs = traces.load_mt_bench(Path(path) if path else traces.MT_BENCH, opts.output_tokens, upto)
        reqs = _skipped(reqs, opts.skip)
    if not reqs:
        raise ValueError(f"--dataset {opts.dataset}: no requests (an empty file, or --skip past its end)")
    cap = opts.max_output_len
    if cap:  # (before the fit: the cap can make a request fit)
        reqs = [replace(r, output_len=min(r.output_len, cap)) for r in reqs]
    # a dataset without timestamps (prompts, synthetic; a trace whose are all 0) under --arrival
    # trace arrives as a Poisson process at --rate (decided on the rows read, before any is left
    # out: kept rows of one timestamp re-based to 0 are still a burst)
    poisson = opts.arrival == "poisson" or (opts.arrival == "trace" and all(r.arrival_s == 0 for r in reqs))
    before = len(reqs)
    if context_length and opts.over_context == "skip":
        reqs = _fitting(reqs, context_length, opts.dataset)
    if poisson:
        reqs = traces.poisson_arrivals(reqs, opts.rate, opts.bench_seed)
    return Loaded([replace(r, arrival_s=r.arrival_s / opts.load) for r in reqs], poisson, before - len(reqs))


def _arrival(opts: BenchOptions, poisson: bool) -> str:
    """How the requests arrive, as the header says it (`poisson`: as `_load` decided)."""
    if opts.arrival == "concurrency":
        return f"concurrency {opts.concurrency}"
    if poisson:
        said = "" if opts.arrival == "poisson" else " (the requests' timestamps are all 0)"
        return f"poisson at {opts.rate:g} requests/s{said}"
    return "trace"


def _fitting(reqs: list[BenchRequest], context_length: int, dataset: str) -> list[BenchRequest]:
    """The requests whose prompt + output fit the model's context (the router refuses the
    others, each with INVALID_ARGUMENT), with a line on stderr counting the ones left out, their
    arrivals re-based on the first kept one's. A text prompt's length is known only once
    tokenized: it counts as one token. Raises ValueError when none fits."""
    kept = [r for r in reqs if max(r.prompt_len, 1) + r.output_len <= context_length]
    if len(kept) == len(reqs):
        return reqs
    if not kept:
        raise ValueError(f"every request of --dataset {dataset} has a prompt + output longer than the model's "
                         f"context ({context_length} tokens): give a dataset that fits (--dataset mt-bench, or "
                         "synthetic-prefix with a shorter --prefix-len and --suffix-len), or --over-context send to "
                         "send them anyway (the router refuses each)")
    print(f"tandem bench: left out {len(reqs) - len(kept)} of {len(reqs)} requests whose prompt + output exceed "
          f"the model's context ({context_length} tokens; --over-context send sends them, each refused)",
          file=sys.stderr)
    return _rebased(kept)  # the first kept request arrives at once, as after --skip


def _skipped(reqs: list[BenchRequest], skip: int) -> list[BenchRequest]:
    """reqs from row `skip` on, numbered from 0, their arrivals counted from the first kept one's."""
    return _rebased([replace(r, index=i) for i, r in enumerate(reqs[skip:])])


def _rebased(reqs: list[BenchRequest]) -> list[BenchRequest]:
    """reqs with their arrivals counted from the first one's."""
    t0 = reqs[0].arrival_s if reqs else 0.0
    return [replace(r, arrival_s=r.arrival_s - t0) for r in reqs]


_FILES = {"azure": "an Azure LLM inference trace: a CSV with TIMESTAMP, ContextTokens and GeneratedTokens columns",
          "sharegpt": "a ShareGPT JSON file: a list of {\"conversations\": [{\"value\": PROMPT}, ...]}"}


def _sampling(opts: BenchOptions) -> str:
    """How the requests sample, for the start line (--temperature may come from TANDEM_TEMPERATURE
    or a config file's `temperature`, which `tandem generate` reads too)."""
    how = "greedy" if opts.temperature == 0 else f"temperature {opts.temperature} (seeds {opts.bench_seed} + i)"
    return how + (f", top {opts.top_logprobs} log-probabilities" if opts.top_logprobs else "")


def _need(path: str, name: str) -> str:
    if not path:
        raise ValueError(f"--dataset {name} needs a path: {name}:PATH, {_FILES[name]}")
    return path


async def _model_info(router: str, wait_s: float = 180.0, api_key: str = "",
                      credentials: Callable[[], TlsCredentials | None] | None = None):
    """The router's model, once it answers and its set of decode workers has stopped growing
    (so `tandem up --mocker N & tandem bench` works as one command; with a key that is not an
    admin's, ExplainRoute is refused and the model is taken as soon as the router answers).

    credentials: when given, looked up again after each failed attempt and, when they changed,
    used from then on (also as this process's, common.tls.TLS): the CA file a starting
    `tandem up` leaves for local clients appears only once its cluster is up.
    Raises RuntimeError naming the router when it does not answer within wait_s seconds."""
    import grpc

    from cli.client import frontend_stub
    from cli.client import no_router_hint
    from common import tls
    from common.pb.tandem.v1 import frontend_pb2

    deadline = time.monotonic() + wait_s
    seen, stable, said = -1, 0, False
    ch, stub = frontend_stub(router, api_key=api_key)
    try:
        while True:
            try:
                model = (await stub.ListModels(frontend_pb2.ListModelsRequest(), timeout=5)).models[0]
                try:
                    resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                        return model
                    raise
                n = sum(1 for c in resp.candidates if c.role == "decode")
                stable = stable + 1 if n == seen else 0
                seen = n
                if stable >= 4:
                    return model
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # waiting will not mend a missing or wrong key
                    what = ("it does not accept the --api-key given" if api_key
                            else "it takes API keys: give --api-key KEY, or TANDEM_API_KEY")
                    raise RuntimeError(f"router {router}: UNAUTHENTICATED: {exc.details()} ({what})") from None
                if time.monotonic() > deadline:
                    hint = no_router_hint(exc, router, tls.TLS is not None)
                    raise RuntimeError(f"router {router} not ready after {wait_s:.0f} s: {exc.code().name}"
                                       f"{hint}") from None
                if credentials is not None:
                    try:
                        now = credentials()
                    except ValueError:  # the CA file went between the look and the read
                        now = None
                    if (now and now.ca) != (tls.TLS and tls.TLS.ca):
                        tls.TLS = now
                        await ch.close()
                        ch, stub = frontend_stub(router, api_key=api_key)
            if not said:
                print(f"tandem bench: waiting for the router at {router} and its workers (up to {wait_s:g} s, "
                      f"--router-wait)", file=sys.stderr)
                said = True
            await asyncio.sleep(0.5)
    finally:
        await ch.close()


class _TermAsInterrupt:
    """While a run goes on, SIGTERM (`timeout`, a job's stop) ends it as Ctrl-C does: where
    asyncio.run handles SIGINT, SIGTERM raises SIGINT, which cancels the run at its next await;
    where SIGINT is ignored (a script's background job) it raises KeyboardInterrupt itself. The
    requests that finished are reported either way. `seen`: whether SIGTERM came; `restore` puts the previous handler back.
    In a thread other than the main one (no signal handlers there) it does nothing."""

    def __init__(self) -> None:
        self.seen = False
        self._installed = threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGTERM, self._on_term) if self._installed else None

    def _on_term(self, signum: int, frame: object) -> None:
        self.seen = True
        if callable(signal.getsignal(signal.SIGINT)):  # asyncio.run's handler (or Python's default)
            signal.raise_signal(signal.SIGINT)
        else:  # SIGINT ignored: asyncio.run installed none (it replaces Python's default only)
            raise KeyboardInterrupt

    def restore(self) -> None:
        if self._installed:  # (a handler set outside Python reads as None: the default then)
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


def write_results(path: Path, opts: dict, summary: dict, reqs: list[BenchRequest], results: list[RequestResult],
                  extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"options": opts, "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                        "cpus": __import__("os").cpu_count()},
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "summary": summary, **(extra or {}),
           "requests": [{**asdict(r), "chunks": r.chunks, "prompt_len": q.prompt_len or r.prompt_tokens,
                         "arrival_s": q.arrival_s} for r, q in zip(results, reqs)]}
    path.write_text(json.dumps(doc) + "\n")


def run(opts: BenchOptions, credentials: Callable[[], TlsCredentials | None] | None = None) -> dict:
    """Run the bench; returns the summary (also printed, and written with --out). credentials:
    see `_model_info`."""
    load_requests(opts, 2)  # a bad --dataset fails now, not after waiting for the router
    if opts.out:  # and an --out that cannot be written, not after the whole run
        out = Path(opts.out)
        if out.is_dir():
            raise ValueError(f"--out {opts.out}: is a folder; give a file name (the results' JSON; plots go beside it)")
        out.parent.mkdir(parents=True, exist_ok=True)  # (an OSError names the path)
    if not 0 <= opts.router_wait_s < float("inf"):  # (NaN too)
        raise ValueError(f"--router-wait must be a finite number of seconds >= 0, got {opts.router_wait_s}")
    model = asyncio.run(_model_info(opts.router, opts.router_wait_s, api_key=opts.api_key, credentials=credentials))
    reqs, poisson, left_out = _loaded(opts, model.vocab_size, model.context_length)
    if opts.arrival == "concurrency":
        reqs = [replace(r, arrival_s=0.0) for r in reqs]
    http_url = ""
    if opts.backend == "openai":
        http_url = (opts.http_url or model.http_url).rstrip("/")
        if not http_url:
            raise ValueError(f"--backend openai: the router at {opts.router} serves no HTTP API (start it with "
                             "--http-port), and no --http-url was given")
    target = f"{http_url}/v1/completions" if http_url else opts.router
    print(f"tandem bench: {len(reqs)} requests ({opts.dataset}) to {target} (model {model.name}, block size "
          f"{model.block_size}), arrival {_arrival(opts, poisson)}, load {opts.load}, speedup {opts.speedup}, "
          f"{_sampling(opts)}", file=sys.stderr)
    state = LoadState()
    terminated = _TermAsInterrupt()
    try:
        results, wall = asyncio.run(run_load(opts.router, reqs, opts.speedup,
                                             opts.concurrency if opts.arrival == "concurrency" else 0, opts.timeout_s,
                                             http_url=http_url, model=model.name, api_key=opts.api_key,
                                             connections=opts.connections, http_ca=opts.http_ca,
                                             sampling=BenchSampling(opts.temperature, opts.top_logprobs,
                                                                    opts.bench_seed), state=state))
        interrupted = False
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM): the requests that finished are still a result
        results, wall = state.finished()
        interrupted = True
        print(f"\ntandem bench: interrupted after {wall:.0f} s; {len(results)} of {len(reqs)} requests had finished "
              "(the table counts those)", file=sys.stderr)
    finally:
        terminated.restore()
    ran = reqs
    if interrupted:  # the requests that finished, in request order (write_results pairs them so)
        done = {r.index for r in results}
        ran = [q for q in reqs if q.index in done]
    summary = summarize(ran, results, wall, opts.speedup)
    summary.update(traces.oracle_summary(ran, model.block_size))
    if left_out:
        summary["left_out_over_context"] = left_out
    if interrupted:
        summary.update(interrupted=True, requests_planned=len(reqs), signal="SIGTERM" if terminated.seen else "SIGINT")
    print(table(summary, "Serving Benchmark Result (interrupted)" if interrupted else "Serving Benchmark Result"))
    if opts.out:
        from bench.plots import plot_runs

        out = Path(opts.out)
        write_results(out, asdict(opts), summary, ran, results)
        label = opts.label or opts.dataset
        paths = plot_runs([(label, ran, results, opts.speedup)], out.with_suffix(""), label)
        print(f"wrote {out} and {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return summary


def add_parser(sub) -> None:
    """Register `tandem bench` (flags from BenchOptions)."""
    from cli.flags import add_flags

    p = sub.add_parser("bench", help="replay a trace or prompts against a router; report like sglang.bench_serving")
    add_flags(p, BenchOptions)
    p.set_defaults(func=_main)


def _main(args) -> int:
    from cli.client import client_credentials
    from cli.flags import build
    from common import tls

    opts = build(BenchOptions, args)
    tls.TLS = client_credentials(opts)  # every channel of this client process (bench/client.py)
    # without --tls-ca, a local `tandem up` still starting may leave its CA file while we wait
    local = not opts.tls_ca and not opts.tls_cert
    summary = run(opts, credentials=(lambda: client_credentials(opts)) if local else None)
    if summary.get("interrupted"):  # 128 + the signal's number, as a shell reports it
        return 128 + (signal.SIGTERM if summary.get("signal") == "SIGTERM" else signal.SIGINT)
    return 1 if summary["failed"] else 0
