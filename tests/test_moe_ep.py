"""Expert-parallel dispatch/combine (engine/moe_ep.py) against the dense MoE forward, with two
real gloo processes on loopback."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.config import ModelConfig
from engine.moe_ep import ExpertPlacement, per_rank_counts, select_backend

CONTIGUOUS = None  # placement marker: ExpertPlacement.contiguous


def small_config() -> ModelConfig:
    return dataclasses.replace(ModelConfig.tiny(), vocab_size=64, bos_token_id=1, eos_token_id=(2,),
                               num_hidden_layers=2, num_nextn_predict_layers=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, owner, token_counts, results) -> None:
    import torch.distributed as dist

    from engine.model import build_model
    from engine.moe_ep import install_expert_parallel, moe_layers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        c = small_config()
        model = build_model(c, seed=3)
        moe = moe_layers(model)[0]
        g = torch.Generator().manual_seed(100 + rank)
        out = {}
        inputs = [torch.randn(n, c.hidden_size, generator=g) for n in token_counts[rank]]
        with torch.inference_mode():
            dense = [moe(x) for x in inputs]
            placement = (ExpertPlacement.contiguous(c.n_routed_experts, world) if owner is None
                         else ExpertPlacement(tuple(owner), world))
            stats = install_expert_parallel(model, placement, rank)
            assert all(isinstance(m.experts[e], torch.nn.Module) and not list(m.experts[e].parameters())
                       for m in moe_layers(model) for e in range(c.n_routed_experts)
                       if e not in placement.local_experts(rank))
            ep = [moe(x) for x in inputs]
        out["max_err"] = max((float((a - b).abs().max()) if a.numel() else 0.0) for a, b in zip(dense, ep))
        out["exact"] = all(torch.equal(a, b) for a, b in zip(dense, ep))
        out["shapes_ok"] = all(a.shape == b.shape for a, b in zip(dense, ep))
        out["collectives"] = stats.collectives
        out["pairs"] = (stats.pairs_sent, stats.pairs_received)
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("owner,token_counts", [
    (CONTIGUOUS, [[5, 1, 7], [3, 0, 9]]),     # contiguous halves; one rank idle in one call
    ((0, 1, 1, 0, 0, 1, 1, 0), [[0, 4], [6, 0]]),  # a placement table; each rank idle once
])
def test_dispatch_combine_equals_dense_moe(owner, token_counts):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(2, free_port(), owner, token_counts, results), nprocs=2, join=True)
        results = dict(results)
    k = small_config().num_experts_per_tok
    for rank in (0, 1):
        r = results[rank]
        assert r["shapes_ok"]
        assert r["max_err"] < 1e-6, r
        assert r["collectives"] == 3 * len(token_counts[0])  # counts, dispatch, combine per call
    # every pair sent is received by someone
    sent = sum(results[r]["pairs"][0] for r in (0, 1))
    assert sent == sum(results[r]["pairs"][1] for r in (0, 1)) == k * sum(map(sum, token_counts))


def test_placement_validation_and_counts():
    p = ExpertPlacement.contiguous(8, 2)
    assert p.local_experts(0) == [0, 1, 2, 3] and p.local_experts(1) == [4, 5, 6, 7]
    assert per_rank_counts(torch.tensor([[0, 5], [6, 7]]), p) == [1, 3]
    with pytest.raises(ValueError, match="--ep-size 3"):
        ExpertPlacement.contiguous(8, 3)
    with pytest.raises(ValueError, match="hold no expert"):
        ExpertPlacement((0, 0, 0, 0), 2)


def test_backend_selection_never_falls_back_silently():
    assert select_backend("torch", "cpu") == "torch"
    assert select_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("deepep", "cpu")
    with pytest.raises(ValueError, match="--ep-backend"):
        select_backend("nccl2", "cpu")
