"""A worker's Prometheus metrics (docs/observability.md, "Worker metrics").

WorkerStats counters, the KV pool, the KV event log and the request counts are read at scrape
time, on the worker's event loop, by one collector; the request path only observes a few
histograms (prefill duration, prefill batch tokens and chunks, KV transfer duration).

To export a new WorkerStats field, add one line to WORKER_COUNTERS. A field whose value is a
dict {backend: number} is exported with a `backend` label per key. Transfer counters come
per backend from `WorkerStats.transfer_by_backend` (TRANSFER_COUNTERS).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily

from common.gc_pauses import process_clock
from common.metrics import LATENCY_BUCKETS, FunctionCollector, counter, gauge

# WorkerStats field -> (metric name without _total, help, labelled by transfer backend).
# Fields another branch adds (retractions, spec_*) are exported as soon as WorkerStats has them.
WORKER_COUNTERS: dict[str, tuple[str, str, bool]] = {
    "remote_prefills": ("tandem_worker_remote_prefills", "decode: prompts whose KV came from a prefill worker", False),
    "local_prefills": ("tandem_worker_local_prefills", "decode: prompts prefilled on this worker", False),
    "prefill_cached_tokens": ("tandem_worker_prefill_cached_tokens", "prefill: prompt tokens taken from this "
                              "worker's prefix cache instead of computed", False),
    "prefix_query_tokens": ("tandem_worker_prefix_cache_query_tokens", "prompt tokens looked up in the prefix "
                            "cache", False),
    "prefix_hit_tokens": ("tandem_worker_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", False),
    "generated_tokens": ("tandem_worker_generated_tokens", "decode: tokens generated (first tokens included)", False),
    "retractions": ("tandem_worker_retractions", "decode: running requests retracted to free KV blocks", False),
    "fenced_prefills": ("tandem_worker_fenced_prefills", "decode: prefill calls that ended unanswered; their "
                        "destination blocks were held out of the pool until the prefill worker was done", False),
    "fences_released_by_peer": ("tandem_worker_fences_released_by_peer", "decode: fenced blocks released once the "
                                "prefill worker answered Abandon (no write of that request can come)", False),
    "fences_released_peer_gone": ("tandem_worker_fences_released_peer_gone", "decode: fenced blocks released once "
                                  "nothing listened at the prefill worker's address (dead, or done draining)", False),
    "fences_expired": ("tandem_worker_fences_expired", "decode: fenced blocks released after 2 × "
                       "(--prefill-timeout + --transfer-timeout) without an answer from the prefill worker", False),
    "late_writes_refused": ("tandem_worker_kv_late_writes_refused", "prefill: KV writes not posted because the "
                            "decode worker's call had already ended (its deadline passed, or it abandoned the request)", False),
    "prefill_forwards": ("tandem_worker_prefill_forwards", "prefill forwards run (each packs the next chunks of "
                         "concurrent prompts, up to --max-prefill-tokens)", False),
    "prefill_chunks": ("tandem_worker_prefill_chunks", "prompt chunks computed by those forwards (chunks / forwards "
                       "= the mean batch)", False),
    "prefill_inflight_waits": ("tandem_worker_prefill_inflight_waits", "prefill: prompts that waited for the "
                               "blocks of a shared prefix another prompt was computing, then took them from the "
                               "prefix cache", False),
    "prefill_paced_pieces": ("tandem_worker_prefill_paced_pieces", "decode: local prefill pieces run between two "
                             "decode steps while requests decoded (--prefill-tokens-per-decode-step)", False),
    "prefill_pace_timeouts": ("tandem_worker_prefill_pace_timeouts", "decode: of those, pieces that ran after "
                              "waiting 0.25 s for a decode step that did not come", False),
    "solo_yields": ("tandem_worker_solo_yields", "decode: requests that fit only alone, retracted after a turn of "
                    "--solo-wait seconds so that requests waiting behind them could run (they resume later)", False),
    "decode_steps": ("tandem_worker_decode_steps", "decode: batched decode steps launched", False),
    "decode_launches": ("tandem_worker_decode_launches", "decode, overlap scheduler: model-thread calls that "
                        "launched decode steps (steps / launches = the steps queued per call, "
                        "--decode-steps-per-launch)", False),
    "decode_step_rows": ("tandem_worker_decode_step_rows", "decode: requests in those steps (rows / steps = the "
                         "mean batch)", False),
    "decode_busy_steps": ("tandem_worker_decode_busy_steps", "decode: steps followed by the next launch with no "
                          "idle wait for work in between", False),
    "decode_busy_step_rows": ("tandem_worker_decode_busy_step_rows", "decode: requests in the busy steps (row "
                              "seconds / busy step rows = the time per token a stream sees)", False),
    "decode_step_seconds": ("tandem_worker_decode_step_seconds", "decode: wall seconds from each busy launch to the "
                            "next (/ busy steps = the step cadence a stream sees)", False),
    "decode_device_wait_seconds": ("tandem_worker_decode_device_wait_seconds", "decode, overlap scheduler: host "
                                   "seconds spent waiting for a step's result (near the cadence: device-bound; near "
                                   "0: host-bound)", False),
    "decode_device_busy_seconds": ("tandem_worker_decode_device_busy_seconds", "decode, overlap scheduler on CUDA "
                                   "(one-token steps; MTP steps are not timed): device seconds the steps ran, from "
                                   "CUDA events around each step's forward and result copy, the first recorded once the "
                                   "host has planned the step (/ wall time = the device's busy share; / steps = "
                                   "the device time of a step)", False),
    "decode_device_idle_seconds": ("tandem_worker_decode_device_idle_seconds", "decode, overlap scheduler on CUDA: "
                                   "device seconds between a step's result copy and the next step's start (CUDA events; "
                                   "the device waited for the host then: / busy steps = the idle gap a step leaves)",
                                   False),
    "decode_row_seconds": ("tandem_worker_decode_row_seconds", "decode: each busy step's requests × its share of the "
                           "seconds until the next launch (that span split over its launch's steps), summed (/ busy "
                           "step rows = the time per token a stream sees, as the clients' TPOT weighs a step: once "
                           "per request in it; per verify step with MTP)", False),
    "spec_verify_steps": ("tandem_worker_spec_verify_steps", "decode: MTP verify steps", False),
    "spec_emitted_tokens": ("tandem_worker_spec_emitted_tokens", "decode: tokens emitted by MTP verify steps "
                            "(accept length = emitted / verify steps)", False),
}

# BackendTransferStats field (WorkerStats.transfer_by_backend) -> (metric name without _total, help);
# one series per backend actually used (kv_transfer/select.py picks it per peer pair).
TRANSFER_COUNTERS: dict[str, tuple[str, str]] = {
    "transfers": ("tandem_worker_kv_transfers", "prefill: requests whose KV reached the decode worker"),
    "writes": ("tandem_worker_kv_transfer_writes", "prefill: write_blocks calls (one per finished chunk, plus "
               "the last with the notification)"),
    "failures": ("tandem_worker_kv_transfer_failures", "prefill: requests whose KV transfer failed"),
    "bytes": ("tandem_worker_kv_transfer_bytes", "prefill: KV bytes written to decode workers"),
    "seconds": ("tandem_worker_kv_transfer_seconds", "prefill: seconds from a request's first write to its "
                "notification"),
    "exposed_seconds": ("tandem_worker_kv_transfer_exposed_seconds", "prefill: seconds from the end of the "
                        "prefill to the notification (the transfer time left after overlap)"),
}

TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(4, 18))  # 16 .. 131072 tokens
CHUNK_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0)


class WorkerMetrics:
    """Owns one worker's registry; `running_fn` (decode: requests in the batch) and
    `prefill_channels_fn` (decode: open channels to prefill workers) are set by the role."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.registry = CollectorRegistry()
        self.prefill_duration = Histogram(
            "tandem_worker_prefill_duration_seconds", "chunked prefill of one prompt (compute only), by where: "
            "remote (a prefill worker) or local (a decode worker)", ["where"], buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self.prefill_batch_tokens = Histogram(
            "tandem_worker_prefill_batch_tokens", "tokens of one prefill forward (chunks of concurrent prompts "
            "packed up to --max-prefill-tokens)", buckets=TOKEN_BUCKETS, registry=self.registry)
        self.prefill_batch_chunks = Histogram(
            "tandem_worker_prefill_batch_chunks", "prompt chunks in one prefill forward", buckets=CHUNK_BUCKETS,
            registry=self.registry)
        self.transfer_duration = Histogram(
            "tandem_worker_kv_transfer_duration_seconds", "prefill: one KV transfer, submission to completion",
            ["backend"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.gc_clock = process_clock()  # this process's collections (installed once per process)
        self.running_fn: Callable[[], int] | None = None
        self.prefill_channels_fn: Callable[[], int] | None = None
        self.collector = FunctionCollector(self._collect)
        self.registry.register(self.collector)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Collect on `loop` (the one that owns the pool and the counters)."""
        self.collector.loop = loop

    def _collect(self) -> Iterator[Any]:
        rt = self.rt
        for field, (name, doc, _) in WORKER_COUNTERS.items():
            value = getattr(rt.stats, field, None)
            if isinstance(value, dict):
                fam = CounterMetricFamily(name, doc, labels=["backend"])
                for key, v in value.items():
                    fam.add_metric([str(key)], v)
                yield fam
            elif value is not None:
                yield counter(name, doc, value)
        per_backend = getattr(rt.stats, "transfer_by_backend", {})
        for field, (name, doc) in TRANSFER_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["backend"])
            for key, st in per_backend.items():
                fam.add_metric([key], getattr(st, field))
            yield fam
        for name, doc, values in (
                ("tandem_worker_gc_collections", "garbage collections of this process by generation",
                 self.gc_clock.collections),
                ("tandem_worker_gc_seconds", "seconds this process's garbage collections took, by generation (the "
                 "process's threads wait meanwhile: a decode step's host work is late by as much; --gc-freeze "
                 "keeps the start-up heap out of them)", self.gc_clock.seconds)):
            fam = CounterMetricFamily(name, doc, labels=["generation"])
            for gen, v in enumerate(values):
                fam.add_metric([str(gen)], v)
            yield fam
        clock = getattr(rt, "prefill_clock", None)
        if clock is not None:
            yield counter("tandem_worker_prefill_device_seconds", "device seconds of this worker's prefill forwards "
                          "(CUDA events around each forward on its stream; wall time on a CPU). / wall time = "
                          "the share of the device prefill took: on a GPU shared with a decode worker, time "
                          "its decode steps could not have", clock.seconds())
        blocks = rt.pool.blocks
        total = blocks.num_blocks
        used = total - blocks.num_free
        yield gauge("tandem_worker_kv_blocks", "KV pool capacity in blocks", total)
        yield gauge("tandem_worker_kv_used_blocks", "KV blocks referenced by requests", used)
        yield gauge("tandem_worker_kv_cached_blocks", "KV blocks in the prefix cache (referenced or not)",
                    blocks.num_cached)
        yield gauge("tandem_worker_kv_usage_ratio", "used / capacity", used / total)
        query = getattr(rt.stats, "prefix_query_tokens", 0)
        yield gauge("tandem_worker_prefix_cache_hit_ratio", "prefix cache hit tokens / query tokens since start "
                    "(rate() of the two counters gives it over a window)",
                    getattr(rt.stats, "prefix_hit_tokens", 0) / query if query else 0.0)
        queued = rt.batcher.queued
        running = (self.running_fn() if self.running_fn is not None
                   else max(0, rt.in_flight - rt.model_waiting - queued))
        yield gauge("tandem_worker_requests_in_flight", "requests being served (RPCs in progress)", rt.in_flight)
        yield gauge("tandem_worker_running_requests", "decode: requests in the decode batch; prefill: requests not "
                    "waiting for the model thread", running)
        yield gauge("tandem_worker_queue_depth", "requests in flight and not running (waiting for KV, a batch "
                    "slot or the model thread)", max(0, rt.in_flight - running))
        yield gauge("tandem_worker_model_queue_depth", "model calls waiting for the model thread", rt.model_waiting)
        yield gauge("tandem_worker_prefill_queued_chunks", "prefill chunks waiting for a batched forward "
                    "(engine/prefill_batch.py)", queued)
        if self.prefill_channels_fn is not None:
            yield gauge("tandem_worker_prefill_channels", "decode: open channels to prefill workers (one per "
                        "prefill worker in discovery it has called; closed when the record leaves)",
                        self.prefill_channels_fn())
        yield counter("tandem_worker_kv_event_batches", "KV event batches published", rt.events.last_event_id)
        yield gauge("tandem_worker_draining", "1 while draining after SIGTERM", 1.0 if rt.draining else 0.0)
        yield gauge("tandem_worker_engine_stalled", "1 while one model call has run over --stall-timeout",
                    1.0 if rt.stalled() else 0.0)
