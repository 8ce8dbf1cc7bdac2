#!/usr/bin/env python3
"""Benchmarks of the router's KV index (router/kv_index.py, docs/architecture.md). Not a test.

Default mode, on one Python thread:

  (1) decision latency: block_hashes(token ids) + KvIndex.overlaps + a trivial cost scoring over
      all workers (cost_w = w*(B - overlap_w) + load_w, argmin), for prompts of 1K, 8K, 32K and
      128K tokens, block sizes 16 and 64, 8 / 64 / 256 workers, with an index holding a combined
      1M (and 10M, when the memory estimate allows) (worker, block) entries. Workload: "documents"
      = one of 8 shared 1,024-token system prompts + a random body, 2K..128K tokens
      (log-uniform); each document is held by 4 random workers, each holding a random-length
      prefix; a query shares a random-length prefix of a random document (10% of queries share
      nothing) and is filled up with fresh tokens. p50 / p99 in microseconds over --queries
      queries per cell, plus the worst case for overlaps alone (512 blocks held in full by one
      worker, or staggered so a worker drops out at every depth).
  (2) event ingestion: the index of every cell is built from BlockStored events of 16..64
      blocks (parent = the previous block, as an engine emits them) and torn down with
      BlockRemoved events of 16..64 blocks in random order: blocks/s for each.
  (3) memory: RSS growth of a fresh process per million (worker, block) entries (KvIndex and
      ApproxIndex), measured in a child process so nothing else is in the way.

--mooncake mode: our equivalent of ../shared/peers/dynamo/bench_indexer.py (NVIDIA Dynamo's
RadixTree through its Python bindings) on the same Mooncake conversation trace, same insertion
scheme (first 5,000 requests, request i to worker i % 16, each worker stores only the blocks it
lacks, parent = its last held block), same queries (rows 5000..5999, 50 warm-up calls), same key
(block hash = trace hash_id), and hashing 4K / 128K random tokens at block size 64 with
common.block_hash.block_hashes; then it runs Dynamo's script with --dynamo-python in a child
process right after ours and prints both with ratios (Dynamo time / ours: > 1 means ours is
faster).

Usage:
  python tools/bench_router.py [--json PATH] [--queries 200] [--entries 1000000,10000000]
  python tools/bench_router.py --mooncake [--dynamo-python /tmp/dynvenv/bin/python] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

import numpy as np  # noqa: E402

from common.block_hash import block_hashes, hash_seed  # noqa: E402
from router.approx_index import ApproxIndex  # noqa: E402
from router.kv_index import KvIndex, WorkerId  # noqa: E402

SEED = hash_seed("bench-model")
VOCAB = 32_000
SYS_PROMPTS = 8
SYS_TOKENS = 1024
HOLDERS_PER_DOC = 4
PREFILL_WEIGHT = 1.0
DEFAULT_TRACE = REPO.parent / "shared" / "datasets" / "mooncake" / "conversation_trace.jsonl"
DEFAULT_DYN_BENCH = REPO.parent / "shared" / "peers" / "dynamo" / "bench_indexer.py"


# ------------------------------------------------------------------------------------ helpers

def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def loadavg() -> list[float]:
    return list(os.getloadavg())


def q(sorted_vals: list[float], p: float) -> float:
    """Quantile with linear interpolation (the same definition as Dynamo's bench_indexer.py)."""
    k = (len(sorted_vals) - 1) * p
    f = int(k)
    c = min(f + 1, len(sorted_vals) - 1)
    return sorted_vals[f] + (sorted_vals[c] - sorted_vals[f]) * (k - f)


def stats_us(ns: list[int]) -> dict:
    us = sorted(v / 1000.0 for v in ns)
    return {"n": len(us), "mean_us": statistics.mean(us), "p50_us": q(us, 0.5), "p90_us": q(us, 0.9),
            "p99_us": q(us, 0.99), "min_us": us[0], "max_us": us[-1]}


def noise_probe(reps: int = 2000) -> dict:
    """The machine's noise floor: a fixed ~50 µs pure-Python loop timed `reps` times. On an
    idle core p99 / p50 stays near 1; preemption by other processes shows up as a high p99 / max."""
    def work() -> int:
        s = 0
        for i in range(2000):
            s += i
        return s
    ns = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        work()
        ns.append(time.perf_counter_ns() - t0)
    return stats_us(ns)


def gen2_collections() -> int:
    return gc.get_stats()[2]["collections"]


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = [f"\n{title}"] if title else []
    out.append("| " + " | ".join(c.rjust(w) for c, w in zip(cells[0], widths)) + " |")
    out.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for r in cells[1:]:
        out.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        if v >= 100:
            return f"{v:,.0f}"
        if v >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


# ------------------------------------------------------------------------------- workload

class Corpus:
    """Documents for one block size: a shared system prompt + a random body each.

    Document d's tokens are regenerated from its seed when a query needs them, so only the
    block-hash chains stay in memory.
    """

    def __init__(self, block_size: int, target_blocks: int, rng: random.Random,
                 max_tokens: int = 131_072) -> None:
        self.block_size = block_size
        self.sys_tokens = [np.random.default_rng(10_000 + i).integers(0, VOCAB, SYS_TOKENS, dtype=np.uint32)
                           for i in range(SYS_PROMPTS)]
        self.sys_hashes = [block_hashes(t, block_size, SEED) for t in self.sys_tokens]
        self.docs: list[tuple[int, int, int]] = []   # (system prompt, body seed, body tokens)
        self.chains: list[list[int]] = []
        total = 0
        lo, hi = math.log(2 * SYS_TOKENS), math.log(max_tokens)
        while total < target_blocks:
            n_tok = int(math.exp(rng.uniform(lo, hi)))
            body = max(block_size, (n_tok - SYS_TOKENS) // block_size * block_size)
            sp, seed = rng.randrange(SYS_PROMPTS), 1_000_000 + len(self.docs)
            toks = np.random.default_rng(seed).integers(0, VOCAB, body, dtype=np.uint32)
            chain = self.sys_hashes[sp] + block_hashes(toks, block_size, SEED, parent=self.sys_hashes[sp][-1])
            self.docs.append((sp, seed, body))
            self.chains.append(chain)
            total += len(chain)
        self.total_blocks = total

    def doc_tokens(self, d: int) -> np.ndarray:
        sp, seed, body = self.docs[d]
        return np.concatenate([self.sys_tokens[sp],
                               np.random.default_rng(seed).integers(0, VOCAB, body, dtype=np.uint32)])

    def query(self, n_tokens: int, rng: random.Random) -> tuple[list[int], int]:
        """A prompt of n_tokens token ids (a Python list, as the tokenizer returns) that shares a
        random-length prefix with a random document (none for 10% of queries). Returns
        (tokens, shared tokens)."""
        fresh = np.random.default_rng(rng.getrandbits(63)).integers(0, VOCAB, n_tokens, dtype=np.uint32)
        if rng.random() < 0.1:
            return fresh.tolist(), 0
        d = rng.randrange(len(self.docs))
        doc = self.doc_tokens(d)
        shared = rng.randint(0, min(len(doc), n_tokens))
        fresh[:shared] = doc[:shared]
        return fresh.tolist(), shared


def make_events(corpus: Corpus, workers: list[WorkerId], entries: int, rng: random.Random
                ) -> tuple[list[tuple[WorkerId, int | None, list[int]]], int]:
    """BlockStored events filling an index with about `entries` (worker, block) pairs: random
    (document, worker, prefix length) assignments, each cut into events of 16..64 blocks with
    parent = the previous block; a worker stores only blocks it does not hold yet (like an
    engine). Returns (events, entries)."""
    held: list[dict[int, int]] = [{} for _ in workers]        # worker -> doc -> held prefix length
    held_sys: list[dict[int, int]] = [{} for _ in workers]    # worker -> system prompt -> blocks held
    sys_blocks = SYS_TOKENS // corpus.block_size
    events = []
    n = 0
    n_docs = len(corpus.chains)
    while n < entries:
        d = rng.randrange(n_docs)
        chain = corpus.chains[d]
        sp = corpus.docs[d][0]
        for wi in rng.sample(range(len(workers)), min(HOLDERS_PER_DOC, len(workers))):
            p = rng.randint(1, len(chain))
            # blocks the worker holds already: its prefix of this document, and the shared
            # system prompt's blocks it cached for another document
            have = max(held[wi].get(d, 0), min(held_sys[wi].get(sp, 0), p))
            if p <= have:
                continue
            held[wi][d] = p
            held_sys[wi][sp] = max(held_sys[wi].get(sp, 0), min(p, sys_blocks))
            k = have
            while k < p and n < entries:
                size = min(rng.randint(16, 64), p - k, entries - n)
                events.append((workers[wi], chain[k - 1] if k else None, chain[k:k + size]))
                k += size
                n += size
            if n >= entries:
                break
    return events, n


def cost_argmin(ov: dict, n_blocks: int, workers: list[WorkerId], load: dict) -> WorkerId:
    """cost_w = prefill_weight * (B - overlap_w) + load_w; lowest wins (docs/architecture.md, step 2)."""
    best, best_cost = workers[0], math.inf
    get = ov.get
    for w in workers:
        c = PREFILL_WEIGHT * (n_blocks - get(w, 0)) + load[w]
        if c < best_cost:
            best, best_cost = w, c
    return best


# ------------------------------------------------------------------------ decision latency

def bench_config(corpus: Corpus, n_workers: int, entries: int, prompt_tokens: list[int],
                 n_queries: int, rng: random.Random) -> dict:
    bs = corpus.block_size
    workers = [WorkerId(f"worker-{i:03d}") for i in range(n_workers)]
    events, n_entries = make_events(corpus, workers, entries, rng)
    idx = KvIndex()
    for w in workers:
        idx.add_worker(w)
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    for w, parent, hashes in events:
        idx.apply_stored(w, parent, hashes)
    ingest_s = time.perf_counter() - t0
    rss1 = rss_bytes()
    res = {"block_size": bs, "workers": n_workers, "entries": idx.total_entries,
           "unique_blocks": idx.unique_blocks, "stored_events": len(events),
           "ingest_blocks_per_s": n_entries / ingest_s, "ingest_s": ingest_s,
           "rss_delta_build_bytes": rss1 - rss0, "rss_after_build_bytes": rss1,
           "unknown_parent": idx.counters.unknown_parent,
           "stored_duplicates": idx.counters.stored_duplicates, "loadavg_start": loadavg(), "cells": []}
    load = {w: rng.randrange(0, 4096 // bs * 8) for w in workers}
    # the benchmark's own corpus and event lists (tracked by the cycle collector, unlike the
    # index, which holds only ints) would make full collections slow and pollute p99: freeze them
    gc.collect()
    gc.freeze()
    g2 = gen2_collections()
    for n_tok in prompt_tokens:
        queries = [corpus.query(n_tok, rng) for _ in range(n_queries + 10)]
        gc.collect()
        t_hash, t_ov, t_score, t_total, hit, best_o = [], [], [], [], [], []
        for i, (tokens, _shared) in enumerate(queries):
            a = time.perf_counter_ns()
            hs = block_hashes(tokens, bs, SEED)
            b = time.perf_counter_ns()
            ov = idx.overlaps(hs)
            c = time.perf_counter_ns()
            cost_argmin(ov, len(hs), workers, load)
            d = time.perf_counter_ns()
            if i < 10:
                continue                                        # warm-up
            t_hash.append(b - a)
            t_ov.append(c - b)
            t_score.append(d - c)
            t_total.append(d - a)
            m = max(ov.values(), default=0)
            best_o.append(m)
            hit.append(m / len(hs))
        res["cells"].append({
            "prompt_tokens": n_tok, "blocks": n_tok // bs, "queries": len(t_total),
            "best_overlap_frac_mean": statistics.mean(hit), "best_overlap_blocks_mean": statistics.mean(best_o),
            "hash": stats_us(t_hash), "overlaps": stats_us(t_ov), "score": stats_us(t_score),
            "total": stats_us(t_total)})
    # worst cases for overlaps alone: 512 blocks, (a) held in full by one worker, (b) staggered:
    # worker i holds the first 512 - i blocks, so one (or more) workers drop out at every depth
    long_chain = next((c for c in corpus.chains if len(c) >= 512), None)
    if long_chain is not None:
        qh = long_chain[:512]
        worst = {}
        for label in ("one_holder_full", "staggered_all_workers"):
            if label == "one_holder_full":
                idx.apply_stored(workers[0], None, qh)
            else:
                for i, w in enumerate(workers):
                    idx.apply_stored(w, None, qh[: 512 - (i % 512)])
            gc.collect()
            ns = []
            for r in range(n_queries + 10):
                a = time.perf_counter_ns()
                idx.overlaps(qh)
                b = time.perf_counter_ns()
                if r >= 10:
                    ns.append(b - a)
            worst[label] = stats_us(ns)
        res["overlaps_worst_512"] = worst
    res["gen2_collections_during_queries"] = gen2_collections() - g2
    gc.unfreeze()
    # teardown with BlockRemoved events: (a) the first half of the stored events removed in the
    # order they were stored (oldest first, like an LRU cache), same batches; (b) the rest in
    # random order, batches of 16..64 blocks of one worker
    half = len(events) // 2
    fifo = [(w, hs) for w, _p, hs in events[:half]]
    gc.collect()
    t0 = time.perf_counter()
    for w, hs in fifo:
        idx.apply_removed(w, hs)
    res["remove_fifo_blocks_per_s"] = sum(len(h) for _, h in fifo) / (time.perf_counter() - t0)
    removals = []
    for w in workers:
        bl = list(idx.blocks(w))
        rng.shuffle(bl)
        k = 0
        while k < len(bl):
            size = rng.randint(16, 64)
            removals.append((w, bl[k:k + size]))
            k += size
    rng.shuffle(removals)
    n_rm = sum(len(h) for _, h in removals)
    gc.collect()
    t0 = time.perf_counter()
    for w, hs in removals:
        idx.apply_removed(w, hs)
    rm_s = time.perf_counter() - t0
    assert idx.total_entries == 0 and idx.unique_blocks == 0
    assert idx.counters.removed_unknown == 0
    res["remove_random_blocks_per_s"] = n_rm / rm_s
    res["loadavg_end"] = loadavg()
    del idx, events, removals
    gc.collect()
    return res


def bench_approx(n_queries: int, rng: random.Random) -> dict:
    """ApproxIndex on the hot path: record (after routing) + overlaps for 8K-token prompts,
    bs 16, 64 workers, with a full index (1M entries) and steady TTL expiry."""
    ax = ApproxIndex(ttl_s=120.0, max_blocks_per_worker=1_000_000 // 64)
    workers = [WorkerId(f"worker-{i:03d}") for i in range(64)]
    now = 0.0
    shared = [rng.getrandbits(64) for _ in range(512)]
    rec_ns, ov_ns = [], []
    for i in range(4000 + n_queries):
        k = rng.randint(0, 512)
        hs = shared[:k] + [rng.getrandbits(64) for _ in range(512 - k)]
        now += 0.05                                   # 20 requests/s: ~2,400 live requests
        a = time.perf_counter_ns()
        ax.overlaps(hs, now)
        b = time.perf_counter_ns()
        ax.record(workers[i % 64], hs, now)
        c = time.perf_counter_ns()
        if i >= 4000:
            ov_ns.append(b - a)
            rec_ns.append(c - b)
    return {"workers": 64, "blocks_per_request": 512, "entries_at_end": ax.index.total_entries,
            "expired_blocks": ax.expired_blocks, "evicted_blocks": ax.evicted_blocks,
            "overlaps_with_expiry": stats_us(ov_ns), "record": stats_us(rec_ns)}


# ---------------------------------------------------------------------------------- memory

def memprobe(entries: int, n_workers: int, kind: str) -> dict:
    """(Child process.) RSS growth for `entries` (worker, block) entries in 64-block chains,
    each chain held by 4 workers (prefixes of random length). Includes the hash int objects
    the index keeps alive; the input lists are freed before the second RSS reading."""
    rng = random.Random(7)
    workers = [WorkerId(f"worker-{i:03d}") for i in range(n_workers)]
    gc.collect()
    r0 = rss_bytes()
    idx = KvIndex() if kind == "kv" else ApproxIndex(ttl_s=1e9, max_blocks_per_worker=entries)
    n = 0
    while n < entries:
        chain = [rng.getrandbits(64) for _ in range(64)]
        for w in rng.sample(workers, min(HOLDERS_PER_DOC, n_workers)):
            p = rng.randint(1, 64)
            if kind == "kv":
                idx.apply_stored(w, None, chain[:p])
            else:
                idx.record(w, chain[:p], 0.0)
            n += p
        del chain
    gc.collect()
    r1 = rss_bytes()
    kv = idx if kind == "kv" else idx.index
    return {"kind": kind, "workers": n_workers, "entries": kv.total_entries,
            "unique_blocks": kv.unique_blocks, "rss_delta_bytes": r1 - r0,
            "bytes_per_entry": (r1 - r0) / kv.total_entries,
            "mb_per_million_entries": (r1 - r0) / kv.total_entries * 1e6 / 1e6}


def run_memprobe(entries: int, n_workers: int, kind: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--_memprobe", f"{entries},{n_workers},{kind}"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------------------- mooncake

def splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def bench_mooncake(args) -> dict:
    rows = []
    with open(args.trace) as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= args.insert_requests + args.query_requests:
                break
    ins, qry = rows[: args.insert_requests], rows[args.insert_requests:]
    n_workers = 16
    workers = [WorkerId(str(i)) for i in range(n_workers)]
    idx = KvIndex()
    held: list[set[int]] = [set() for _ in range(n_workers)]
    apply_ns = []
    blocks_stored = 0
    gc.collect()
    t_build = time.perf_counter()
    for i, r in enumerate(ins):
        w = i % n_workers
        ids = r["hash_ids"]
        k = 0
        while k < len(ids) and ids[k] in held[w]:
            k += 1
        if k == len(ids):
            continue
        new = ids[k:]
        parent = ids[k - 1] if k else None
        t0 = time.perf_counter_ns()
        idx.apply_stored(workers[w], parent, new)
        apply_ns.append(time.perf_counter_ns() - t0)
        held[w].update(new)
        blocks_stored += len(new)
    build_s = time.perf_counter() - t_build
    queries = [r["hash_ids"] for r in qry]
    for qh in queries[:50]:
        idx.overlaps(qh)
    gc.collect()
    gc.freeze()   # the trace rows (not the index) would otherwise slow full collections
    fm_ns, best = [], []
    for qh in queries:
        t0 = time.perf_counter_ns()
        ov = idx.overlaps(qh)
        fm_ns.append(time.perf_counter_ns() - t0)
        best.append(max(ov.values(), default=0))
    rnd = random.Random(1234)
    hash_res = {}
    for label, n, reps in (("4k", 4096, 1000), ("128k", 131072, 100)):
        toks = [rnd.randrange(32000) for _ in range(n)]
        for _ in range(5):
            block_hashes(toks, 64, SEED)
        ns = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            h = block_hashes(toks, 64, SEED)
            ns.append(time.perf_counter_ns() - t0)
        assert block_hashes(toks, n + 1, SEED) == []
        ns0 = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            block_hashes(toks, n + 1, SEED)
            ns0.append(time.perf_counter_ns() - t0)
        hash_res[label] = {"tokens": n, "block_size": 64, "blocks": len(h), **stats_us(ns),
                           "no_full_block_call": stats_us(ns0)}
    qlens = [len(qh) for qh in queries]
    return {
        "build": {"workers": n_workers, "requests_inserted": len(ins), "stored_events": len(apply_ns),
                  "blocks_stored_total_across_workers": blocks_stored, "unique_blocks": idx.unique_blocks,
                  "total_entries": idx.total_entries, "wall_s": build_s, "apply_stored": stats_us(apply_ns)},
        "find_matches": {"requests": len(queries), "trace_rows": [len(ins), len(ins) + len(queries)],
                         "blocks_per_query_mean": statistics.mean(qlens), "blocks_per_query_max": max(qlens),
                         "best_worker_overlap_blocks_mean": statistics.mean(best),
                         "overlaps": stats_us(fm_ns)},
        "block_hashes": hash_res,
    }


def mooncake_main(args, report: dict) -> None:
    report["load_before_ours"] = loadavg()
    report["noise_start"] = noise_probe()
    ours = bench_mooncake(args)
    report["ours"] = ours
    dyn = None
    if args.dynamo_python and Path(args.dynamo_python).exists():
        with tempfile.TemporaryDirectory() as td:
            out = os.path.join(td, "dyn.json")
            cmd = [args.dynamo_python, str(args.dynamo_bench), "--trace", str(args.trace),
                   "--insert-requests", str(args.insert_requests),
                   "--query-requests", str(args.query_requests), "--out", out]
            report["dynamo_cmd"] = " ".join(cmd)
            report["load_before_dynamo"] = loadavg()
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode == 0:
                with open(out) as f:
                    dyn = json.load(f)
            else:
                report["dynamo_error"] = p.stderr[-4000:]
    else:
        report["dynamo_error"] = f"no Dynamo python at {args.dynamo_python} (run ../shared/peers/dynamo/setup.sh)"
    report["dynamo"] = dyn
    report["load_after"] = loadavg()
    report["noise_end"] = noise_probe()

    o = ours
    print(table(["what", "value"], [
        ["requests inserted / stored events", f"{o['build']['requests_inserted']} / {o['build']['stored_events']}"],
        ["worker-blocks / unique blocks", f"{o['build']['total_entries']:,} / {o['build']['unique_blocks']:,}"],
        ["query blocks mean / max", f"{o['find_matches']['blocks_per_query_mean']:.1f} / "
                                    f"{o['find_matches']['blocks_per_query_max']}"],
        ["best-worker overlap mean (blocks), ours", f"{o['find_matches']['best_worker_overlap_blocks_mean']:.3f}"],
        ["same, Dynamo", f"{dyn['find_matches']['best_worker_overlap_blocks_mean']:.3f}" if dyn else "n/a"],
    ], "Mooncake conversation trace, 16 workers (same inputs for both)"))
    rows = []

    def row(name, ours_s, dyn_s):
        r = [name, ours_s["p50_us"], ours_s["p99_us"], ours_s["mean_us"]]
        if dyn_s:
            r += [dyn_s["p50_us"], dyn_s["p99_us"], dyn_s["mean_us"],
                  f"{dyn_s['p50_us'] / ours_s['p50_us']:.2f}x", f"{dyn_s['p99_us'] / ours_s['p99_us']:.2f}x"]
        else:
            r += ["n/a"] * 5
        rows.append(r)

    d = dyn or {}
    row("lookup: overlaps vs find_matches (1,000 queries)", o["find_matches"]["overlaps"],
        d.get("find_matches", {}).get("default"))
    row("  same, Dynamo early_exit=True", o["find_matches"]["overlaps"],
        d.get("find_matches", {}).get("early_exit_true"))
    row("insert: apply_stored vs apply_event (per event)", o["build"]["apply_stored"],
        d.get("build", {}).get("apply_event"))
    for label in ("4k", "128k"):
        row(f"hash {label} tokens, block 64", o["block_hashes"][label],
            d.get("compute_block_hash_for_seq", {}).get(label))
        row("  same, no full block (ours returns before reading the list)",
            o["block_hashes"][label]["no_full_block_call"],
            (d.get("compute_block_hash_for_seq", {}).get(label) or {}).get("no_full_block_call"))
    print(table(["operation", "ours p50 µs", "ours p99 µs", "ours mean µs", "Dynamo p50 µs",
                 "Dynamo p99 µs", "Dynamo mean µs", "p50 Dyn/ours", "p99 Dyn/ours"], rows,
                "Ours (tandem KvIndex, in-process Python) vs Dynamo 1.6.1 (Python bindings), same run"))
    print(table(["when", "p50 µs", "p99 µs", "max µs"],
                [[k, report[k]["p50_us"], report[k]["p99_us"], report[k]["max_us"]]
                 for k in ("noise_start", "noise_end")],
                "Noise floor: a fixed ~50 µs Python loop (p99 far above p50 = preemption by other load)"))
    if report.get("dynamo_error"):
        print("\nDynamo:", report["dynamo_error"])


# ------------------------------------------------------------------------------------ main

def default_main(args, report: dict) -> None:
    rng = random.Random(args.seed)
    entries_list = [int(float(x)) for x in args.entries.split(",")]
    worker_list = [int(x) for x in args.workers.split(",")]
    bs_list = [int(x) for x in args.block_sizes.split(",")]
    prompt_list = [int(x) for x in args.prompt_tokens.split(",")]

    report["noise_start"] = noise_probe()
    # (3) memory first, in fresh child processes (also decides whether 10M fits)
    mem = []
    probe_n = min(entries_list)
    for kind in ("kv", "approx"):
        mem.append(run_memprobe(probe_n, 64, kind))
    per_entry = mem[0]["bytes_per_entry"]
    for e in sorted(set(entries_list) - {probe_n}):
        need = per_entry * e * 1.5           # + corpus chains and events of the benchmark
        if need < args.mem_limit_gb * 2**30 and need < mem_available_bytes() * 0.7:
            mem.append(run_memprobe(e, 64, "kv"))
    report["memory"] = mem
    print(table(["index", "workers", "entries", "unique blocks", "RSS delta MB", "bytes / entry",
                 "MB / 1M entries"],
                [[m["kind"], m["workers"], m["entries"], m["unique_blocks"], m["rss_delta_bytes"] / 1e6,
                  m["bytes_per_entry"], m["mb_per_million_entries"]] for m in mem],
                "(3) Memory: RSS growth of a fresh process (hash ints included)"))

    configs = []
    skipped = []
    for entries in entries_list:
        need = per_entry * entries * 1.3 + 16 * entries      # index + chains + events
        if need > args.mem_limit_gb * 2**30 or need > mem_available_bytes() * 0.7:
            skipped.append(f"{entries:,} entries skipped: needs ~{need / 2**30:.1f} GiB "
                           f"(limit {args.mem_limit_gb} GiB, available {mem_available_bytes() / 2**30:.1f} GiB)")
            continue
        for bs in bs_list:
            corpus = Corpus(bs, entries // 2, rng)
            for nw in worker_list:
                t0 = time.perf_counter()
                prompts = prompt_list if entries == min(entries_list) or args.all_prompts_at_scale \
                    else [p for p in prompt_list if p in (8192, 131072)]
                res = bench_config(corpus, nw, entries, prompts, args.queries, rng)
                res["corpus_docs"] = len(corpus.docs)
                res["corpus_blocks"] = corpus.total_blocks
                res["wall_s"] = time.perf_counter() - t0
                configs.append(res)
                print(f"[bench] entries={entries:,} bs={bs} workers={nw} done in {res['wall_s']:.1f}s "
                      f"(rss {rss_bytes() / 2**30:.2f} GiB, load {os.getloadavg()[0]:.2f})", flush=True)
            del corpus
            gc.collect()
    report["decision"] = configs
    report["skipped"] = skipped

    rows = []
    for c in configs:
        for cell in c["cells"]:
            rows.append([f"{c['entries'] / 1e6:.3g}M", c["block_size"], c["workers"], cell["prompt_tokens"],
                         cell["blocks"], f"{cell['best_overlap_frac_mean'] * 100:.0f}%",
                         cell["hash"]["p50_us"], cell["hash"]["p99_us"],
                         cell["overlaps"]["p50_us"], cell["overlaps"]["p99_us"],
                         cell["score"]["p50_us"], cell["score"]["p99_us"],
                         cell["total"]["p50_us"], cell["total"]["p99_us"]])
    print(table(["entries", "bs", "workers", "tokens", "blocks", "hit", "hash p50", "hash p99",
                 "overlaps p50", "overlaps p99", "score p50", "score p99", "total p50", "total p99"], rows,
                f"(1) Decision latency, µs ({args.queries} queries per cell; hit = mean best overlap / blocks)"))
    rows = [[f"{c['entries'] / 1e6:.3g}M", c["block_size"], c["workers"],
             c["overlaps_worst_512"]["one_holder_full"]["p50_us"], c["overlaps_worst_512"]["one_holder_full"]["p99_us"],
             c["overlaps_worst_512"]["staggered_all_workers"]["p50_us"],
             c["overlaps_worst_512"]["staggered_all_workers"]["p99_us"]]
            for c in configs if "overlaps_worst_512" in c]
    print(table(["entries", "bs", "workers", "1 holder p50", "1 holder p99", "staggered p50", "staggered p99"],
                rows, "(1b) overlaps worst case, 512 blocks all held, µs"))
    rows = [[f"{c['entries'] / 1e6:.3g}M", c["block_size"], c["workers"], c["stored_events"], c["unique_blocks"],
             c["ingest_blocks_per_s"] / 1e6, c["remove_fifo_blocks_per_s"] / 1e6,
             c["remove_random_blocks_per_s"] / 1e6, c["rss_delta_build_bytes"] / 1e6]
            for c in configs]
    print(table(["entries", "bs", "workers", "stored events", "unique blocks", "apply_stored M blocks/s",
                 "apply_removed FIFO M/s", "apply_removed random M/s", "RSS delta MB (in-process)"], rows,
                "(2) Event ingestion (events of 16..64 blocks)"))
    ap = bench_approx(args.queries, rng)
    report["approx"] = ap
    print(table(["op", "p50 µs", "p99 µs", "mean µs"],
                [["ApproxIndex.overlaps (lazy expiry)", ap["overlaps_with_expiry"]["p50_us"],
                  ap["overlaps_with_expiry"]["p99_us"], ap["overlaps_with_expiry"]["mean_us"]],
                 ["ApproxIndex.record", ap["record"]["p50_us"], ap["record"]["p99_us"], ap["record"]["mean_us"]]],
                f"ApproxIndex, 512-block requests, 64 workers, {ap['entries_at_end']:,} live entries"))
    report["noise_end"] = noise_probe()
    print(table(["when", "p50 µs", "p99 µs", "max µs"],
                [[k, report[k]["p50_us"], report[k]["p99_us"], report[k]["max_us"]]
                 for k in ("noise_start", "noise_end")],
                "Noise floor: a fixed ~50 µs Python loop (p99 far above p50 = preemption by other load)"))
    print("gen2 collections during timed queries per config:",
          [c["gen2_collections_during_queries"] for c in configs])
    for s in skipped:
        print("note:", s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--queries", type=int, default=200, help="timed queries per cell (after 10 warm-up)")
    ap.add_argument("--entries", default="1000000,10000000", help="combined (worker, block) entries")
    ap.add_argument("--workers", default="8,64,256")
    ap.add_argument("--block-sizes", default="16,64")
    ap.add_argument("--prompt-tokens", default="1024,8192,32768,131072")
    ap.add_argument("--all-prompts-at-scale", action="store_true",
                    help="all prompt lengths at the larger entry counts too (default: 8K and 128K only)")
    ap.add_argument("--mem-limit-gb", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mooncake", action="store_true", help="the Mooncake / Dynamo comparison instead")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--insert-requests", type=int, default=5000)
    ap.add_argument("--query-requests", type=int, default=1000)
    ap.add_argument("--dynamo-python", default="/tmp/dynvenv/bin/python")
    ap.add_argument("--dynamo-bench", default=str(DEFAULT_DYN_BENCH))
    ap.add_argument("--_memprobe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memprobe:
        e, w, kind = args._memprobe.split(",")
        print(json.dumps(memprobe(int(e), int(w), kind)))
        return 0
    report = {"date": dt.date.today().isoformat(), "argv": sys.argv,
              "env": {"python": sys.version.split()[0], "machine": platform.machine(),
                      "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                      "mem_total_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
                      "loadavg_start": loadavg()}}
    t0 = time.perf_counter()
    if args.mooncake:
        mooncake_main(args, report)
    else:
        default_main(args, report)
    report["wall_s"] = time.perf_counter() - t0
    report["env"]["loadavg_end"] = loadavg()
    report["env"]["max_rss_bytes"] = __import__("resource").getrusage(
        __import__("resource").RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nwall {report['wall_s']:.1f} s, load average start {report['env']['loadavg_start']} "
          f"end {report['env']['loadavg_end']}, max RSS {report['env']['max_rss_bytes'] / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
