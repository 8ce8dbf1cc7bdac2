#!/usr/bin/env python3
"""What observability costs on the request path (docs/bench/obs.md). Not a test.

Times, on one thread, the hooks one request runs through, with tracing off (no OTLP endpoint:
the default) and, for comparison, with an SDK tracer that samples every span (no exporter, so
only the span bookkeeping is timed):

  - `tracing.span(...)` enter/exit (off: the shared no-op), with and without attributes;
  - the router's per-request metrics: RequestTimer (TTFT + ITL per token + duration + outcome
    counter) and the decision histogram;
  - a log record through the JSON formatter with request id and trace id (the set-up of
    `--log-format json`), against the text formatter.

Then it adds the hooks up per request (yardstick, timed in the same run: block hashes of a
1,024-token prompt; router: 2 spans, 1 current-span read, 1 decision
observation, 1 timer with `--tokens` token observations; prefill: 2 + `--chunks` spans and 2
histogram observations; decode: 2 spans, 1 current-span read) and prints the total, in
microseconds, with `--out` writing the numbers as JSON.

Usage: python tools/bench_obs_overhead.py [--n 200000] [--tokens 64] [--chunks 4] [--out PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import logs, tracing  # noqa: E402
from router.decision import Candidate, RouteDecision, Scores  # noqa: E402
from router.metrics import RouterMetrics  # noqa: E402


def per_call_ns(fn, n: int) -> float:
    """Best of 5 runs of n calls, in nanoseconds per call."""
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t) / n)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000, help="calls per timing")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--chunks", type=int, default=4, help="prefill chunks per request")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    n = args.n
    assert not tracing.enabled(), "run without OTEL_EXPORTER_OTLP_ENDPOINT"
    res: dict[str, float] = {}

    def span_off():
        with tracing.span("tandem.prefill.chunk", {"tandem.chunk.index": 1, "tandem.chunk.start": 2}):
            pass

    res["span_off_ns"] = per_call_ns(span_off, n)
    res["current_span_off_ns"] = per_call_ns(lambda: tracing.current_span().set_attribute("a", 1), n)

    from opentelemetry.sdk.trace import TracerProvider
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("bench")  # samples all, exports nothing

    def span_on():
        with tracer.start_as_current_span("tandem.prefill.chunk", attributes={"tandem.chunk.index": 1,
                                                                              "tandem.chunk.start": 2}):
            pass

    res["span_on_sampled_ns"] = per_call_ns(span_on, n // 4)

    m = RouterMetrics()
    c = Candidate("decode-1", "127.0.0.1:1", "decode", 3, 10.0, 12.0)
    decision = RouteDecision("kv", 64, 4, c, None, "no prefill worker", (Scores.of("decode", [c]),), 2e-5)
    res["decision_observe_ns"] = per_call_ns(lambda: m.observe_decision(decision), n)
    tokens = args.tokens

    def one_request():
        t = m.request_timer()
        for _ in range(tokens):
            t.tokens(1)
        t.done("length", "OK")

    res["request_timer_per_request_ns"] = per_call_ns(one_request, max(1, n // (10 * tokens)))

    for fmt in ("text", "json"):
        buf = io.StringIO()
        logs.setup("info", fmt, stream=buf)
        lg = logging.getLogger("router.service")
        logs.request_id.set("0123456789abcdef")

        def log_line():
            lg.info("request %s: decode worker %s answered %s", "r", "decode-1", "OK")
            buf.seek(0)
            buf.truncate()

        res[f"log_line_{fmt}_ns"] = per_call_ns(log_line, n // 10)

    # A yardstick measured in the same run: hashing a 1,024-token prompt (part of every routing decision).
    from common.block_hash import block_hashes
    prompt = list(range(1024))
    res["yardstick_block_hashes_1k_ns"] = per_call_ns(lambda: block_hashes(prompt, 16, 0), max(1, n // 100))

    spans_per_request = 2 + 2 + args.chunks + 2  # router (route, attempt) + prefill (+chunks, transfer) + decode
    res["hooks_off_per_request_us"] = (spans_per_request * res["span_off_ns"] + 3 * res["current_span_off_ns"]
                                       + res["decision_observe_ns"] + res["request_timer_per_request_ns"]) / 1e3
    res["tracing_off_per_request_us"] = (spans_per_request * res["span_off_ns"]
                                         + 3 * res["current_span_off_ns"]) / 1e3
    res["spans_on_per_request_us"] = spans_per_request * res["span_on_sampled_ns"] / 1e3
    for k, v in res.items():
        print(f"{k:34s} {v:12.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
