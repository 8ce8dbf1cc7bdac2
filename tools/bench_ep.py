"""Wide-EP decode throughput: EP ranks (decode_worker/ep_ranks.py) against one process.

For each EP size, fill `--batch` requests with a `--context`-token prompt (prefilled on the
owning rank), then time `--steps` greedy decode steps of the whole batch through the same
runner calls the decode scheduler makes; the EP sizes' steps are interleaved. EP 1 is today's path (`ModelRunner` over one
`KvPool`); EP N runs N rank processes in lock-step with the MoE all-to-alls over
torch.distributed (gloo on CPU). It reports tokens/s, ms per step, and each rank's time inside
the all-to-all calls as a share of the step (on gloo that time includes waiting for the
slowest rank). The greedy tokens of every EP size must match EP 1's, or the run fails.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/bench_ep.py --model tandem-shakespeare \\
        --ep-sizes 1,2 --batch 8 --context 128 --steps 16 --out docs/bench/ep-run.json

With --device cuda, rank r runs on GPU r (bf16 weights, NCCL all-to-alls, the fast decode
path of each rank with its CUDA graphs unless --disable-cuda-graph; EP 1 on GPU 0): there the all-to-all time is not measured per step (it would
need a device sync around each collective; tools/bench_ep_moe.py times one MoE layer's), and
the EP sizes' greedy tokens are compared as a share of identical tokens instead of failing the
run (bf16 sums in another order may flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from common.block_hash import hash_seed
from common.sampling_params import SamplingParams
from engine.ep_placement import ExpertPlacement, plan_redundant, rank_loads
from engine.kv_pool import KvPool, KvPoolConfig
from engine.model_source import load_model
from engine.runner import DecodeInput, ModelRunner


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(17 + 31 * i + 7 * j) % vocab for j in range(n)]


class Setup:
    """One EP size's runner with `batch` prefilled requests."""

    def __init__(self, spec: str, ep: int, batch: int, context: int, max_len: int, threads: int,
                 placement_file: str = "", device: str = "cpu", graphs: bool = False) -> None:
        torch.set_num_threads(threads)
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        loaded = load_model(spec, dtype=dtype)
        c = loaded.config
        bs = 16
        cfg = KvPoolConfig(num_blocks=batch * -(-max_len // bs) + 4, block_size=bs,
                           num_layers=c.num_kv_layers, kv_dim=c.kv_dim, dtype=dtype)
        self.ep, self.batch, self.context = ep, batch, context
        self.engine = None
        if ep == 1:
            self.pool = KvPool(cfg, hash_seed(loaded.name), device=dev)
            self.runner = ModelRunner(loaded.model.to(dev), self.pool)
            if graphs:  # as a decode worker on a GPU does at start-up
                self.runner.capture_graphs(batch, max_len)
        else:
            from decode_worker.ep_ranks import EpEngine
            placement = (ExpertPlacement.from_file(placement_file, c.n_routed_experts, ep) if placement_file
                         else None)
            self.engine = EpEngine(spec, 0, ep, "torch", threads, 300.0, cfg, hash_seed(loaded.name), placement,
                                   device=dev)
            self.pool, self.runner = self.engine.pool, self.engine  # type: ignore[assignment]
            if graphs:  # every rank's, in lock-step
                self.engine.capture_graphs(batch, max_len)
        self.reqs = []
        t0 = time.perf_counter()
        for i in range(batch):
            tokens = _prompt(i, context, c.vocab_size)
            p = self.pool.allocate_prompt(tokens)
            hidden = self.runner.prefill_chunk(p.block_ids, tokens, 0, len(tokens))
            tokens.append(int(self.runner.logits(hidden).argmax()))
            self.reqs.append((p.block_ids, tokens))
        self.prefill_s = time.perf_counter() - t0
        self.step_times: list[float] = []

    def step(self) -> None:
        for block_ids, tokens in self.reqs:
            self.pool.grow(block_ids, len(tokens))
        inputs = [DecodeInput(b, len(t) - 1, t[-1]) for b, t in self.reqs]
        greedy = [(SamplingParams(), len(t)) for _, t in self.reqs]
        t0 = time.perf_counter()
        new = self.runner.decode_tokens(inputs, greedy).tokens  # the scheduler's call (one host copy)
        self.step_times.append(time.perf_counter() - t0)
        for (_, tokens), tok in zip(self.reqs, new):
            tokens.append(tok)

    def mark(self) -> None:
        """Start of the timed steps."""
        self.step_times = []
        if self.engine is not None:
            st = self.engine.stats
            self._mark = (st.step_s, st.own_s, list(st.comm_s), list(st.pairs_received))
            self._load0 = self.engine.expert_load()

    def decode_load(self) -> list[int]:
        """Expert loads of the timed decode steps (the prompts' prefill routes differently)."""
        assert self.engine is not None
        return [a - b for a, b in zip(self.engine.expert_load(), self._load0)]

    def result(self) -> dict:
        steps = len(self.step_times)
        timed = sum(self.step_times)
        out = {"ep_size": self.ep, "batch": self.batch, "context": self.context, "steps": steps,
               "tokens_per_s": self.batch * steps / timed, "ms_per_step": 1000 * timed / steps,
               "ms_per_step_median": 1000 * statistics.median(self.step_times), "prefill_s": self.prefill_s,
               "tokens_per_s_per_rank": self.batch * steps / timed / self.ep}
        if self.engine is not None:
            st = self.engine.stats
            step_s, own_s, comm0, pairs0 = self._mark
            step_s = st.step_s - step_s
            comm = [a - b for a, b in zip(st.comm_s, comm0)]
            timed = any(comm)  # off on CUDA (engine/moe_ep.py EpStats.timed)
            out["all_to_all_share_per_rank"] = [x / step_s for x in comm] if timed else None
            out["all_to_all_ms_per_step_per_rank"] = [1000 * x / steps for x in comm] if timed else None
            out["rank0_own_share"] = (st.own_s - own_s) / step_s
            out["placed_per_rank"] = list(self.engine.pool.assigned)
            out["decode_expert_load"] = self.decode_load()
            out["redundant_copies"] = [list(x) for x in self.engine.placement.replicas]
            pairs = [a - b for a, b in zip(st.pairs_received, pairs0)]  # expert work each rank did
            out["expert_pairs_per_rank"] = pairs
            out["rank_load_max_over_mean"] = max(pairs) / (sum(pairs) / len(pairs))
        return out

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _imbalance(load: list[int], placement: ExpertPlacement) -> float:
    per_rank = rank_loads(load, placement)
    return max(per_rank) / (sum(per_rank) / len(per_rank))


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
    ap.add_argument("--ep-placement", default="", help="expert placement JSON for the EP > 1 runs")
    ap.add_argument("--plan-out", default="", help="write a placement with --redundant copies of hot experts, "
                    "planned from the largest EP run's observed expert loads (use it as --ep-placement)")
    ap.add_argument("--redundant", type=int, default=2, help="redundant expert copies for --plan-out")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: rank r on GPU r, bf16, NCCL (EP 1 on GPU 0)")
    ap.add_argument("--disable-cuda-graph", action="store_true",
                    help="on cuda: eager decode steps (default: CUDA graphs, as the workers)")
    a = ap.parse_args()
    max_len = a.context + a.warmup + a.steps + 1
    setups: list[Setup] = []
    try:
        for ep in a.ep_sizes.split(","):
            setups.append(Setup(a.model, int(ep), a.batch, a.context, max_len, a.threads, a.ep_placement, a.device,
                                graphs=a.device == "cuda" and not a.disable_cuda_graph))
        # Interleave the EP sizes step by step, so a shared machine's changing load hits all alike.
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                for s in setups:
                    s.mark()
            for s in setups:
                s.step()
        generated = [[t for _, t in s.reqs] for s in setups]
        results = [s.result() for s in setups]
        if a.plan_out and setups[-1].engine is not None:
            eng, load = setups[-1].engine, setups[-1].decode_load()
            plan = plan_redundant(load, eng.placement, a.redundant)
            Path(a.plan_out).write_text(plan.to_json() + "\n")
            print(f"placement with copies {list(plan.replicas)} written to {a.plan_out}: expected rank load "
                  f"max/mean {_imbalance(load, plan):.2f} (now {_imbalance(load, eng.placement):.2f})")
    finally:
        for s in setups:
            s.close()
    base = results[0]
    for r, g in zip(results, generated):
        same = sum(x == y for a_, b_ in zip(g, generated[0]) for x, y in zip(a_, b_))
        r["identical_token_share"] = same / sum(len(t) for t in generated[0])
        if g != generated[0] and a.device == "cpu":
            raise SystemExit(f"EP {r['ep_size']} generated other tokens than EP {base['ep_size']}")
        share = r.get("all_to_all_share_per_rank")
        print(f"EP {r['ep_size']}: {r['tokens_per_s']:.1f} tok/s, {r['ms_per_step']:.1f} ms/step"
              f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x EP {base['ep_size']}; per rank "
              f"{r['tokens_per_s_per_rank']:.1f}; identical tokens {r['identical_token_share']:.1%})"
              + (f", all-to-all share per rank {', '.join(f'{x:.0%}' for x in share)}"
                 f", rank 0's own share {r['rank0_own_share']:.0%}, rank load max/mean "
                 f"{r['rank_load_max_over_mean']:.2f}" if share else ""))
    if a.out:
        meta = {"model": a.model, "machine": f"{platform.machine()} {torch.get_num_threads()} thread(s)/rank, "
                f"{__import__('os').cpu_count()} CPUs", "torch": torch.__version__, "command_args": vars(a)}
        Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
