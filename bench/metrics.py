"""Summary of a bench run, with the metrics of `sglang.bench_serving`.

Times are reported in trace time: measured real seconds × `speedup` (the mocker's speedup
factor), so a run at speedup 10 reads like the trace at its own pace. Definitions:
TTFT = start → first token; E2E = start → last token; TPOT = (E2E − TTFT) / (output − 1);
ITL = gap between streamed messages divided over the tokens each brings (the mocker streams in
groups); prefix hit rate = Σ cached prompt tokens / Σ prompt tokens (the decode worker's prefix
cache, `Usage.cached_tokens`); block hit rate = Σ cached 512-token trace blocks / Σ trace blocks.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from bench.client import RequestResult
from bench.traces import MOONCAKE_BLOCK, BenchRequest


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def _dist(name: str, xs: list[float], out: dict) -> None:
    ms = [x * 1000 for x in xs]
    out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
    out[f"median_{name}_ms"] = _pct(ms, 0.5)
    out[f"p99_{name}_ms"] = _pct(ms, 0.99)


def summarize(reqs: Sequence[BenchRequest], results: Sequence[RequestResult], wall_s: float,
              speedup: float = 1.0) -> dict:
    by_index = {r.index: r for r in reqs}
    ok = [r for r in results if r.ok]
    s = speedup
    duration = wall_s * s
    out: dict = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
                 "speedup": speedup}
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out.update(total_input_tokens=tin, total_output_tokens=tout, cached_tokens=cached,
               request_throughput=len(ok) / duration if duration else 0.0,
               input_throughput=tin / duration if duration else 0.0,
               output_throughput=tout / duration if duration else 0.0,
               total_token_throughput=(tin + tout) / duration if duration else 0.0,
               prefix_hit_rate=cached / tin if tin else 0.0)
    blocks = sum(len(by_index[r.index].hash_ids) for r in ok)
    if blocks:
        hit_blocks = sum(min(r.cached_tokens // MOONCAKE_BLOCK, len(by_index[r.index].hash_ids)) for r in ok)
        out["block_hit_rate"] = hit_blocks / blocks
    ttft = [r.ttft_s * s for r in ok if r.ttft_s is not None]
    e2e = [(r.end_s - r.start_s) * s for r in ok]
    tpot = [((r.end_s - r.start_s) - r.ttft_s) * s / (r.completion_tokens - 1)
            for r in ok if r.ttft_s is not None and r.completion_tokens > 1]
    itl: list[float] = []
    for r in ok:
        for (t_prev, _), (t, n) in zip(r.chunks, r.chunks[1:]):
            itl.extend([(t - t_prev) * s / n] * n)
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e_latency", e2e)):
        _dist(name, xs, out)
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}  # the first whole message of each kind: what to fix
    for r in results:
        if not r.ok:
            kind = r.error.split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
            examples.setdefault(kind, r.error[:300])
    out["errors"] = errors
    out["error_examples"] = examples
    return out


def over_time(reqs: Sequence[BenchRequest], results: Sequence[RequestResult], speedup: float = 1.0,
              bins: int = 40) -> dict[str, list[float]]:
    """Output throughput (tokens/s) and prefix hit rate of requests finishing in each time bin."""
    ok = [r for r in results if r.ok]
    if not ok:
        return {"t_s": [], "output_tok_s": [], "hit_rate": []}
    end = max(r.end_s for r in ok) * speedup
    width = end / bins if end > 0 else 1.0
    toks = [0.0] * bins
    cached = [0] * bins
    prompt = [0] * bins
    for r in ok:
        for t, n in r.chunks:
            toks[min(bins - 1, int(t * speedup / width))] += n
        b = min(bins - 1, int(r.end_s * speedup / width))
        cached[b] += r.cached_tokens
        prompt[b] += r.prompt_tokens
    return {"t_s": [(i + 0.5) * width for i in range(bins)], "output_tok_s": [x / width for x in toks],
            "hit_rate": [c / p if p else float("nan") for c, p in zip(cached, prompt)]}


ROWS = [("Successful requests", "completed", "{:d}"), ("Failed requests", "failed", "{:d}"),
        ("Benchmark duration (s, trace time)", "duration_s", "{:.2f}"),
        ("Total input tokens", "total_input_tokens", "{:d}"),
        ("Total generated tokens", "total_output_tokens", "{:d}"),
        ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("Input token throughput (tok/s)", "input_throughput", "{:.1f}"),
        ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("Total token throughput (tok/s)", "total_token_throughput", "{:.1f}"),
        ("Prefix hit rate (tokens)", "prefix_hit_rate", "{:.4f}"),
        ("Block hit rate (512-token trace blocks)", "block_hit_rate", "{:.4f}"),
        ("Oracle block hit rate (infinite shared cache)", "oracle_block_hit_rate", "{:.4f}"),
        ("Oracle token hit rate (infinite shared cache)", "oracle_token_hit_rate", "{:.4f}"),
        ("Mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"), ("Median TTFT (ms)", "median_ttft_ms", "{:.1f}"),
        ("P99 TTFT (ms)", "p99_ttft_ms", "{:.1f}"), ("Mean TPOT (ms)", "mean_tpot_ms", "{:.2f}"),
        ("Median TPOT (ms)", "median_tpot_ms", "{:.2f}"), ("P99 TPOT (ms)", "p99_tpot_ms", "{:.2f}"),
        ("Mean ITL (ms)", "mean_itl_ms", "{:.2f}"), ("Median ITL (ms)", "median_itl_ms", "{:.2f}"),
        ("P99 ITL (ms)", "p99_itl_ms", "{:.2f}"), ("Mean E2E latency (ms)", "mean_e2e_latency_ms", "{:.1f}"),
        ("Median E2E latency (ms)", "median_e2e_latency_ms", "{:.1f}"),
        ("P99 E2E latency (ms)", "p99_e2e_latency_ms", "{:.1f}")]


def table(summary: dict, title: str = "Serving Benchmark Result") -> str:
    """The human-readable result, laid out like sglang.bench_serving's."""
    lines = [f"{'=' * 18} {title} {'=' * 18}"]
    width = len(lines[0])
    failed_all = summary.get("completed", 1) == 0
    for label, key, fmt in ROWS:
        if key in summary and not (failed_all and key not in ("completed", "failed")):
            value = fmt.format(summary[key])
            lines.append(f"{label + ':':<{width - len(value)}}{value}")
    if failed_all:
        lines.append("no request succeeded: no throughput or latency to report")
    if summary.get("errors"):
        lines.append(f"errors: {summary['errors']}")
        for kind, message in summary.get("error_examples", {}).items():
            lines.append(f"  e.g. {message}")
    lines.append("=" * width)
    return "\n".join(lines)
