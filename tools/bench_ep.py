"""Wide-EP decode throughput: EP ranks (decode_worker/ep_ranks.py) against one process.

For each EP size, fill `--batch` requests with a `--context`-token prompt (prefilled on the
owning rank), then time `--steps` greedy decode steps of the whole batch through the same
runner calls the decode scheduler makes. EP 1 is today's path (`ModelRunner` over one
`KvPool`); EP N runs N rank processes in lock-step with the MoE all-to-alls over
torch.distributed (gloo on CPU). It reports tokens/s, ms per step, and each rank's time inside
the all-to-all calls as a share of the step (on gloo that time includes waiting for the
slowest rank). The greedy tokens of every EP size must match EP 1's, or the run fails.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/bench_ep.py --model tandem-shakespeare \\
        --ep-sizes 1,2 --batch 8 --context 128 --steps 16 --out docs/bench/ep-run.json

Ranks run on CPU (the worker runtime is CPU-only today); there is no --device cuda.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from common.block_hash import hash_seed
from engine.kv_pool import KvPool, KvPoolConfig
from engine.model_source import load_model
from engine.runner import DecodeInput, ModelRunner


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(17 + 31 * i + 7 * j) % vocab for j in range(n)]


def run_one(spec: str, ep: int, batch: int, context: int, steps: int, warmup: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    loaded = load_model(spec)
    c = loaded.config
    bs = 16
    blocks_per_req = -(-(context + steps + warmup + 1) // bs)
    cfg = KvPoolConfig(num_blocks=batch * blocks_per_req + 4, block_size=bs, num_layers=c.num_hidden_layers,
                       kv_dim=c.kv_dim)
    engine = None
    if ep == 1:
        pool = KvPool(cfg, hash_seed(loaded.name))
        runner = ModelRunner(loaded.model, pool)
    else:
        from decode_worker.ep_ranks import EpEngine
        engine = EpEngine(spec, 0, ep, "torch", threads, 300.0, cfg, hash_seed(loaded.name))
        pool, runner = engine.pool, engine  # type: ignore[assignment]
    try:
        reqs = []
        t0 = time.perf_counter()
        for i in range(batch):
            tokens = _prompt(i, context, c.vocab_size)
            p = pool.allocate_prompt(tokens)
            hidden = runner.prefill_chunk(p.block_ids, tokens, 0, len(tokens))
            tokens.append(int(runner.logits(hidden).argmax()))
            reqs.append((p.block_ids, tokens))
        prefill_s = time.perf_counter() - t0
        step_times = []
        comm0 = [0.0] * ep
        for s in range(warmup + steps):
            if s == warmup and engine is not None:
                comm0 = list(engine.stats.comm_s)
                step0 = engine.stats.step_s
            for block_ids, tokens in reqs:
                pool.grow(block_ids, len(tokens))
            inputs = [DecodeInput(b, len(t) - 1, t[-1]) for b, t in reqs]
            t0 = time.perf_counter()
            logits = runner.decode(inputs)
            step_times.append(time.perf_counter() - t0)
            for (_, tokens), row in zip(reqs, logits):
                tokens.append(int(row.argmax()))
        timed = sum(step_times[warmup:])
        out = {"ep_size": ep, "batch": batch, "context": context, "steps": steps,
               "tokens_per_s": batch * steps / timed, "ms_per_step": 1000 * timed / steps,
               "prefill_s": prefill_s, "generated": [t[context:] for _, t in reqs]}
        if engine is not None:
            step_s = engine.stats.step_s - step0
            comm = [a - b for a, b in zip(engine.stats.comm_s, comm0)]
            out["all_to_all_share_per_rank"] = [x / step_s for x in comm]
            out["all_to_all_ms_per_step_per_rank"] = [1000 * x / steps for x in comm]
            out["placed_per_rank"] = engine.pool.assigned
        return out
    finally:
        if engine is not None:
            engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tandem-shakespeare")
    ap.add_argument("--ep-sizes", default="1,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    a = ap.parse_args()
    results = [run_one(a.model, int(ep), a.batch, a.context, a.steps, a.warmup, a.threads)
               for ep in a.ep_sizes.split(",")]
    base = results[0]
    for r in results:
        if r["generated"] != base["generated"]:
            raise SystemExit(f"EP {r['ep_size']} generated other tokens than EP {base['ep_size']}")
        share = r.get("all_to_all_share_per_rank")
        print(f"EP {r['ep_size']}: {r['tokens_per_s']:.1f} tok/s, {r['ms_per_step']:.1f} ms/step"
              f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x EP {base['ep_size']})"
              + (f", all-to-all share per rank {', '.join(f'{x:.0%}' for x in share)}" if share else ""))
    if a.out:
        meta = {"model": a.model, "machine": f"{platform.machine()} {torch.get_num_threads()} thread(s)/rank, "
                f"{__import__('os').cpu_count()} CPUs", "torch": torch.__version__, "command_args": vars(a)}
        for r in results:
            r.pop("generated")
        Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
