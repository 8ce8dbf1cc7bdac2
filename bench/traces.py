"""Workloads for `tandem bench`: what to send (prompt, output length) and when (arrival time).

Sources:
- Mooncake FAST'25 traces (`mooncake:PATH`, JSONL with timestamp ms, input_length,
  output_length, hash_ids): each hash id stands for one 512-token block; `block_tokens` maps it
  deterministically to token ids (splitmix64 of id·512 + position), so equal ids give equal
  prefixes. The conversation trace's timestamps come in ~3 s steps; requests sharing a step are
  spread evenly over it.
- Azure LLM inference traces 2023 (`azure:PATH`, CSV TIMESTAMP, ContextTokens,
  GeneratedTokens): arrival times and lengths, random token ids (no prefix information).
- ShareGPT (`sharegpt:PATH`, first human turn as text) and MT-Bench (`mt-bench[:PATH]`, both
  turns: turn 2 repeats turn 1 and a stand-in answer, a real two-turn prefix), text prompts.
- Synthetic shared-prefix groups (`synthetic-prefix`): G groups, each a shared prefix of
  P tokens; each request one group's prefix plus S fresh tokens.

Arrivals: the trace's own timestamps, Poisson at a rate, or all at t=0 under a fixed
concurrency (see bench/client.py).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TRACE = ASSETS / "mooncake_conversation_1000.jsonl"  # the shipped slice (LICENSE beside it)
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
MT_BENCH = Path(__file__).resolve().parents[1] / "cli" / "assets" / "mt_bench" / "question.jsonl"
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: token ids or text, how many tokens to generate, when (seconds)."""

    index: int
    arrival_s: float  # seconds after the start, in trace time
    output_len: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    hash_ids: tuple[int, ...] = ()  # Mooncake: 512-token block ids (for block hit rates and the oracle)
    input_len: int = 0  # Mooncake: prompt tokens (made from hash_ids when sent: a full trace's
    vocab: int = 0  # token ids would take gigabytes)

    @property
    def prompt_len(self) -> int:
        return self.input_len if self.hash_ids else len(self.token_ids)

    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids (empty for a text prompt)."""
        if self.hash_ids:
            return mooncake_tokens(list(self.hash_ids), self.input_len, self.vocab)
        return list(self.token_ids)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_tokens(hash_id: int, vocab: int, n: int = MOONCAKE_BLOCK) -> np.ndarray:
    """The token ids standing for Mooncake block `hash_id`: [n] ints in [0, vocab)."""
    pos = np.arange(n, dtype=np.uint64) + np.uint64((hash_id * MOONCAKE_BLOCK) & _MASK)
    with np.errstate(over="ignore"):
        return (_splitmix64(pos) % np.uint64(vocab)).astype(np.int64)


def mooncake_tokens(hash_ids: list[int], input_length: int, vocab: int) -> list[int]:
    """Prompt token ids of a Mooncake row: its blocks' tokens, cut to input_length."""
    parts = [block_tokens(h, vocab) for h in hash_ids]
    toks = np.concatenate(parts)[:input_length] if parts else np.zeros(0, dtype=np.int64)
    return toks.tolist()


def spread_steps(times_ms: list[float], step_ms: float = 3000.0) -> list[float]:
    """Spread requests that share a timestamp evenly over the gap to the next timestamp
    (the conversation trace is quantised to ~3 s steps); the last group over `step_ms`."""
    out = list(times_ms)
    i = 0
    while i < len(out):
        j = i
        while j < len(out) and times_ms[j] == times_ms[i]:
            j += 1
        gap = (times_ms[j] - times_ms[i]) if j < len(out) else step_ms
        for k in range(i, j):
            out[k] = times_ms[i] + gap * (k - i) / (j - i)
        i = j
    return out


def load_mooncake(path: Path, vocab: int, limit: int | None = None, skip: int = 0,
                  spread: bool = True) -> list[BenchRequest]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < skip or not line.strip():
                continue
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        return []
    t0 = rows[0]["timestamp"]
    times = [float(r["timestamp"] - t0) for r in rows]
    quantised = len(set(times)) < len(times) / 2  # conversation trace: most rows share a step
    if spread and quantised:
        times = spread_steps(times)
    return [BenchRequest(i, t / 1000.0, max(1, int(r["output_length"])), hash_ids=tuple(r["hash_ids"]),
                         input_len=int(r["input_length"]), vocab=vocab)
            for i, (r, t) in enumerate(zip(rows, times))]


def load_azure(path: Path, vocab: int, limit: int | None = None, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    t0 = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            ts = dt.datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
            t0 = t0 or ts
            n = max(1, int(row["ContextTokens"]))
            out.append(BenchRequest(len(out), (ts - t0).total_seconds(), max(1, int(row["GeneratedTokens"])),
                                    tuple(rng.integers(0, vocab, n).tolist())))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_sharegpt(path: Path, output_len: int, limit: int | None = None) -> list[BenchRequest]:
    items = json.loads(Path(path).read_text())
    texts = [c["conversations"][0]["value"] for c in items if c.get("conversations")]
    texts = [t for t in texts if t.strip()][:limit]
    return [BenchRequest(i, 0.0, output_len, text=t) for i, t in enumerate(texts)]


def load_mt_bench(path: Path, output_len: int, limit: int | None = None) -> list[BenchRequest]:
    with open(path) as f:
        qs = [json.loads(line) for line in f if line.strip()]
    # Every first turn, then every second turn: a second turn finds its first turn's blocks.
    texts = [q["turns"][0] for q in qs] + [f"{q['turns'][0]}\n\n(answer)\n\n{q['turns'][1]}" for q in qs]
    return [BenchRequest(i, 0.0, output_len, text=t) for i, t in enumerate(texts)][:limit]


def synthetic_prefix(num_requests: int, groups: int, prefix_len: int, suffix_len: int, output_len: int,
                     vocab: int, seed: int = 0) -> list[BenchRequest]:
    """Requests drawn from `groups` shared prefixes of `prefix_len` tokens plus `suffix_len` fresh ones."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, prefix_len) for _ in range(groups)]
    pick = random.Random(seed)
    return [BenchRequest(i, 0.0, output_len,
                         tuple(np.concatenate([prefixes[pick.randrange(groups)],
                                               rng.integers(0, vocab, suffix_len)]).tolist()))
            for i in range(num_requests)]


def poisson_arrivals(reqs: list[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """Replace arrival times with a Poisson process of `rate` requests/second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in reqs:
        out.append(replace(r, arrival_s=t))
        t += rng.expovariate(rate)
    return out


def oracle_summary(reqs: list[BenchRequest], model_block: int) -> dict[str, float]:
    """The bench summary's oracle rows: `oracle_block_hit_rate` (requests with hash ids) and
    `oracle_token_hit_rate`. A trace's hash ids stand for its own 512-token blocks; prompts of
    token ids only are cut into the served model's `model_block`-token blocks (a synthetic
    256-token shared prefix is no hit at all in 512-token blocks)."""
    out: dict[str, float] = {}
    hashed = any(r.hash_ids for r in reqs)
    oracle = oracle_hit_rate(reqs, MOONCAKE_BLOCK if hashed else model_block)
    if hashed:
        out["oracle_block_hit_rate"] = oracle["block"]
    if any(r.prompt_len for r in reqs):
        out["oracle_token_hit_rate"] = oracle["token"]
    return out


def _block_keys(r: BenchRequest, block: int) -> list:
    """A request's block keys: its hash ids, or one per `block`-token prefix of its token ids
    (a trailing partial block included)."""
    if r.hash_ids:
        return list(r.hash_ids)
    t = r.token_ids
    return [hash(t[: (i + 1) * block]) for i in range(-(-len(t) // block))]


def _engine_hits(reqs: list[BenchRequest], block: int):
    """(request, its keys, full blocks an engine would take from an infinite shared cache) per
    request in order: the longest prefix of full blocks that earlier requests stored, leaving at
    least one prompt token to compute (engine/kv_pool.py); only full blocks are stored."""
    full_seen: set = set()
    for r in reqs:
        n, keys = r.prompt_len, _block_keys(r, block)
        kf = 0
        while kf < min(n // block, (n - 1) // block) and keys[kf] in full_seen:
            kf += 1
        full_seen.update(keys[: n // block])
        yield r, keys, kf


def oracle_hit_rate(reqs: list[BenchRequest], block: int = MOONCAKE_BLOCK) -> dict[str, float]:
    """Hit rates of an infinite prefix cache shared by every worker (the bound no router beats).

    "block" / "token": a request reuses the longest prefix of its blocks that any earlier
    request produced (by hash id, or by token blocks) — the Mooncake README's definition, over
    `block`-token blocks, counting a trailing partial block. "engine_block": the same for an
    engine with `block`-token pages, which caches only full blocks and always computes at least
    one prompt token (engine/kv_pool.py), so a trailing partial block is never a hit.
    """
    seen: set = set()
    hit = total = hit_tok = tot_tok = hit_full = 0
    for r, keys, kf in _engine_hits(reqs, block):
        n = r.prompt_len
        k = 0
        while k < len(keys) and keys[k] in seen:
            k += 1
        seen.update(keys)
        hit += k
        hit_full += kf
        total += len(keys)
        hit_tok += min(k * block, n)
        tot_tok += n
    return {"block": hit / total if total else 0.0, "token": hit_tok / tot_tok if tot_tok else 0.0,
            "engine_block": hit_full / total if total else 0.0}


def ttft_lower_bounds(reqs: list[BenchRequest], timing, block: int = MOONCAKE_BLOCK) -> dict[int, float]:
    """Per request index, the TTFT (seconds) no placement can beat under `timing` (mocker/timing.py
    TimingModel): in arrival order, every request finds the longest full-block prefix any
    earlier request produced (an infinite cache shared by all workers: `oracle_hit_rate`'s
    "engine_block", at least one prompt token computed) and prefills the rest in one chunk on an
    idle worker — `timing.prefill_s(cached, rest)`, no queue, no decode steps beside it, no
    transfer. The offline simulator's TTFT also holds the waits, the chunking (which adds an
    overhead per chunk and the same attention pairs) and the mixed decode steps this leaves out,
    and its workers cache at most what this cache holds, so a request's TTFT is at least this —
    provided the workers' blocks are `block` tokens or a multiple of them (smaller blocks cache
    parts of a hash id's block that this does not count). A ratio of mean TTFTs (say round-robin
    / kv) over the same requests is at most round-robin's mean over the mean of these."""
    ordered = sorted(reqs, key=lambda r: (r.arrival_s, r.index))  # bench/sim.py replays in this order
    return {r.index: timing.prefill_s(kf * block, r.prompt_len - kf * block)
            for r, _, kf in _engine_hits(ordered, block)}
