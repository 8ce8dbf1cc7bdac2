"""Expert-parallel dispatch/combine (engine/moe_ep.py) against the dense MoE forward, with two
real gloo processes on loopback."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from engine.config import ModelConfig
from harness import free_port
from engine.ep_placement import ExpertPlacement
from engine.moe_ep import select_backend

# (placement, tokens per call on rank 0, on rank 1); placement None = ExpertPlacement.contiguous
CASES = [
    (None, [5, 1, 7], [3, 0, 9]),  # contiguous halves; rank 1 idle in one call
    (ExpertPlacement((0, 1, 1, 0, 0, 1, 1, 0), 2), [0, 4], [6, 0]),  # a placement table; each rank idle once
    (ExpertPlacement((0, 0, 0, 0, 1, 1, 1, 1), 2, ((1, 1), (6, 0), (2, 1))), [8, 3], [5, 6]),  # redundant copies
]


def small_config() -> ModelConfig:
    return dataclasses.replace(ModelConfig.tiny(), vocab_size=64, bos_token_id=1, eos_token_id=(2,),
                               num_hidden_layers=2, num_nextn_predict_layers=0)




def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import json
    import torch.distributed as dist

    from engine.model import build_model
    from engine.moe_ep import install_expert_parallel, moe_layers

    from datetime import timedelta
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {}
    try:
        c = small_config()
        for case, (placement, *token_counts) in enumerate(CASES):
            placement = placement or ExpertPlacement.contiguous(c.n_routed_experts, world)
            model = build_model(c, seed=3)
            moe = moe_layers(model)[0]
            g = torch.Generator().manual_seed(100 + rank)
            inputs = [torch.randn(n, c.hidden_size, generator=g) for n in token_counts[rank]]
            with torch.inference_mode():
                dense = [moe(x) for x in inputs]
                step = install_expert_parallel(model, placement, rank)
                stats = step.stats
                dropped = [e for e in range(c.n_routed_experts) if e not in placement.local_experts(rank)]
                weightless = all(not list(m.experts[e].parameters()) for m in moe_layers(model) for e in dropped)
                ep = []
                for i, x in enumerate(inputs):
                    # odd calls: the counts given by the caller (a decode step's), even: gathered
                    step.counts = [token_counts[r][i] for r in range(world)] if i % 2 else None
                    ep.append(moe(x))
                step.counts = None
            results[case] = {
                "max_err": max((float((a - b).abs().max()) if a.numel() else 0.0) for a, b in zip(dense, ep)),
                "shapes_ok": all(a.shape == b.shape for a, b in zip(dense, ep)),
                "weightless": weightless, "collectives": stats.collectives,
                "pairs": (stats.pairs_sent, stats.pairs_received),
                "load": stats.expert_load.tolist(),
            }
        # a graph bucket's step: 6 rows on every rank (uniform), some of them padding (real_rows)
        model = build_model(c, seed=3)
        moe = moe_layers(model)[0]
        x = torch.randn(6, c.hidden_size, generator=torch.Generator().manual_seed(7 + rank))
        real = torch.tensor([True, False, True, True, False, False]) if rank == 0 else torch.zeros(6, dtype=torch.bool)
        with torch.inference_mode():
            ids, w = moe.gate(x)
            dense = moe.experts_forward(x, ids, w)
            step = install_expert_parallel(model, ExpertPlacement.contiguous(c.n_routed_experts, world), rank)
            step.uniform, step.real_rows = True, real
            got = moe.experts_forward(x, ids, w)
            step.uniform, step.real_rows = False, None
        results["padded"] = {
            "real_err": float((got[real] - dense[real]).abs().max()) if real.any() else 0.0,
            "padding_zero": bool((got[~real] == 0).all()),
            "load": int(step.stats.expert_load.sum()), "want_load": int(real.sum()) * c.num_experts_per_tok,
            "received": step.stats.pairs_received, "collectives": step.stats.collectives,
        }
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_dispatch_combine_equals_dense_moe(tmp_path, one_torch_thread):
    import json
    # rank 1 is a child process, rank 0 this one (one torch start-up less on a busy machine)
    port = free_port()
    child = mp.get_context("spawn").Process(target=_rank, args=(1, 2, port, str(tmp_path)), daemon=True)
    child.start()
    try:
        _rank(0, 2, port, str(tmp_path))
    finally:
        child.join(120)
    assert child.exitcode == 0
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    results = {(case, r): per_rank[r][str(case)] for case in range(len(CASES)) for r in (0, 1)}
    k = small_config().num_experts_per_tok
    for case, (_, *token_counts) in enumerate(CASES):
        for rank in (0, 1):
            r = results[(case, rank)]
            assert r["shapes_ok"] and r["weightless"], (case, rank)
            assert r["max_err"] < 1e-6, (case, rank, r)
            assert r["collectives"] == 2 * len(token_counts[rank])  # dispatch and combine per call
            assert sum(r["load"]) == k * sum(token_counts[rank])
        # every pair sent is received by someone
        sent = sum(results[(case, r)]["pairs"][0] for r in (0, 1))
        assert sent == sum(results[(case, r)]["pairs"][1] for r in (0, 1)) == k * sum(map(sum, token_counts))
    # padding rows of a graph bucket (real_rows False) reach no expert and count nowhere; rank 1's
    # six rows are all padding (an idle rank) and still join both collectives
    padded = [per_rank[r]["padded"] for r in (0, 1)]
    assert all(p["real_err"] < 1e-6 and p["padding_zero"] and p["load"] == p["want_load"] for p in padded), padded
    assert padded[1]["want_load"] == 0 and all(p["collectives"] == 2 for p in padded)
    assert sum(p["received"] for p in padded) == 3 * k  # rank 0's three real rows × k slots


def test_counts_that_do_not_match_the_tokens_are_refused():
    from engine.model import build_model
    from engine.moe_ep import install_expert_parallel, moe_layers

    c = small_config()
    model = build_model(c, seed=3)
    step = install_expert_parallel(model, ExpertPlacement.contiguous(c.n_routed_experts, 2), 0)
    step.counts = [4, 2]  # this rank has 3 tokens: caught before any collective
    with torch.inference_mode(), pytest.raises(ValueError, match="3 tokens but the step's counts are"):
        moe_layers(model)[0](torch.randn(3, c.hidden_size))
    assert step.stats.collectives == 0


def test_backend_selection_never_falls_back_silently():
    assert select_backend("torch", "cpu") == "torch"
    assert select_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("deepep", "cpu")
    with pytest.raises(ValueError, match="--ep-backend"):
        select_backend("nccl2", "cpu")


def test_bench_ep_script_smoke_on_cpu(tmp_path):
    """tools/bench_ep.py (the EP throughput script; --device cuda on a multi-GPU machine) runs
    EP 1 and EP 2 through the workers' decode_tokens and finds the same greedy tokens."""
    import json
    import subprocess
    import sys
    out = tmp_path / "ep.json"
    subprocess.run([sys.executable, "tools/bench_ep.py", "--model", "tandem-tiny", "--ep-sizes", "1,2", "--batch", "3",
                    "--context", "20", "--steps", "2", "--warmup", "1", "--out", str(out)], check=True, timeout=300,
                   env={**__import__("os").environ, "PYTHONPATH": ".", "OMP_NUM_THREADS": "1"})
    rows = json.loads(out.read_text())["results"]
    assert [r["ep_size"] for r in rows] == [1, 2] and all(r["identical_token_share"] == 1.0 for r in rows)
    assert rows[1]["all_to_all_share_per_rank"] is not None and len(rows[1]["expert_pairs_per_rank"]) == 2
