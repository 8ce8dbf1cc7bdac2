"""One expert-parallel MoE layer (engine/moe_ep.py) on N ranks: correctness against the dense
layer and time per call, on CPU (gloo) or GPUs (NCCL, one GPU per rank).

Each rank builds the same seeded MoE layer (DeepSeek-V3 routing), keeps its experts, and for
each `--tokens` T (tokens per rank) runs dispatch → experts → combine, compared with the dense
layer (all experts) on the same input: the max abs error must stay under `--tol` or the run
fails. It reports ms per EP call, ms per dense call of the same T on one rank, and the share of
the EP call spent in the three all-to-alls (the device is synchronized around each one).

    # 2 GPUs (e.g. nvidia-h200-x2), bf16, a DeepSeek-V2-Lite-sized layer:
    python tools/bench_ep_moe.py --device cuda --world 2 --dtype bfloat16 --hidden 2048 \\
        --experts 64 --topk 6 --groups 8 --topk-groups 3 --moe-inter 1408 --tokens 1,8,64,256 \\
        --out ep_moe_gpu.json
    # CPU smoke test (gloo):
    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/bench_ep_moe.py --device cpu --world 2 --tokens 1,16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _config(a: argparse.Namespace):
    from engine.config import ModelConfig
    return dataclasses.replace(
        ModelConfig.tiny(), hidden_size=a.hidden, moe_intermediate_size=a.moe_inter, n_routed_experts=a.experts,
        num_experts_per_tok=a.topk, n_group=a.groups, topk_group=a.topk_groups)


def _build_moe(c, device: str, dtype: torch.dtype, seed: int):
    from engine.model import MoE, _param_seed

    with torch.device("meta"):
        moe = MoE(c)
    moe = moe.to_empty(device=device)
    for name, t in moe.state_dict(keep_vars=True).items():
        g = torch.Generator().manual_seed(_param_seed(seed, name))
        with torch.no_grad():
            t.copy_(torch.empty(t.shape).normal_(0.0, c.initializer_range, generator=g))
    moe.to(dtype)
    moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.float()
    return moe.eval().requires_grad_(False)


def _timed(fn, x, iters: int, device: str) -> float:
    for _ in range(2):
        fn(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _rank(rank: int, a: argparse.Namespace, port: int, out_dir: str) -> None:
    from engine.ep_placement import ExpertPlacement
    from engine.moe_ep import ExpertParallelDispatch

    torch.set_num_threads(1)
    device = f"cuda:{rank}" if a.device == "cuda" else "cpu"
    if a.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=a.world, timeout=timedelta(seconds=300))
    try:
        dtype = getattr(torch, a.dtype)
        c = _config(a)
        dense = _build_moe(c, device, dtype, seed=1)
        ep = _build_moe(c, device, dtype, seed=1)
        placement = ExpertPlacement.contiguous(c.n_routed_experts, a.world)
        local = placement.local_experts(rank)
        dispatch = ExpertParallelDispatch(placement, rank, {e: ep.experts[e] for e in local})
        for e in range(c.n_routed_experts):
            if e not in local:
                ep.experts[e] = torch.nn.Module()
        ep.experts_forward = dispatch
        rows = []
        with torch.inference_mode():
            for t in a.tokens:
                g = torch.Generator().manual_seed(1000 * rank + t)
                x = torch.randn(t, c.hidden_size, generator=g).to(device, dtype)
                err = float((dense(x).float() - ep(x).float()).abs().max())
                comm0, calls0 = dispatch.stats.comm_s, dispatch.stats.layer_calls
                ep_s = _timed(ep, x, a.iters, device)
                calls = dispatch.stats.layer_calls - calls0
                comm_s = (dispatch.stats.comm_s - comm0) / calls
                dense_s = _timed(dense, x, a.iters, device)
                rows.append({"tokens_per_rank": t, "max_abs_err": err, "ep_ms": 1000 * ep_s, "dense_ms": 1000 * dense_s,
                             "all_to_all_ms": 1000 * comm_s, "all_to_all_share": comm_s / ep_s})
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--topk-groups", type=int, default=1)
    ap.add_argument("--moe-inter", type=int, default=64)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tol", type=float, default=None, help="max abs error allowed (default 1e-5 fp32, 5e-2 else)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    tol = a.tol if a.tol is not None else (1e-5 if a.dtype == "float32" else 5e-2)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(a, port, tmp), nprocs=a.world, join=True)
        per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(a.world)]
    worst = max(row["max_abs_err"] for rows in per_rank for row in rows)
    for i, t in enumerate(a.tokens):
        rs = [rows[i] for rows in per_rank]
        print(f"T={t}/rank: EP {max(r['ep_ms'] for r in rs):.2f} ms (all-to-all "
              f"{max(r['all_to_all_ms'] for r in rs):.2f} ms, {max(r['all_to_all_share'] for r in rs):.0%}), "
              f"dense {max(r['dense_ms'] for r in rs):.2f} ms, max err {max(r['max_abs_err'] for r in rs):.2e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "per_rank": per_rank,
                       "device_name": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"}, f, indent=2)
    if worst > tol:
        raise SystemExit(f"EP MoE differs from the dense layer by {worst:.3e} > {tol:.1e}")


if __name__ == "__main__":
    main()
