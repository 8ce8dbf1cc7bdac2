"""GPU machine: which rounding rope_latent_store's output follows. For a few shapes, the share of
values where the kernel's roped queries, the pool's k_pe and the normalised latent differ from:
the eager plain functions (bf16: each product and sum rounded), the same functions in float32
rounded once, and the compiled function the served step ran before the kernel (torch.compile,
engine/kernels/fused.py). Prints one line per shape and comparison.

    python tools/gpu_runs/latent_rounding.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from engine.kernels.latent_store import rope_latent_store  # noqa: E402
from engine.model import rope_latent  # noqa: E402
from test_latent_store import _inputs  # noqa: E402


def main() -> None:
    compiled = torch.compile(rope_latent, dynamic=True)
    rank, rope = 512, 64
    for t, h, interleave in ((1, 16, True), (64, 16, False), (300, 128, True)):
        q_pe, kv_a, cos, sin, w, blocks, w_blk, w_off = _inputs(t, h, rank, rope, torch.bfloat16, "cuda", seed=t)
        kv = torch.zeros((blocks, 2, 16, rank + rope), device="cuda", dtype=torch.bfloat16)
        q = rope_latent_store(q_pe, kv_a, cos, sin, w, 1e-6, rank, interleave, kv, 1, w_blk, w_off)
        lat = kv[w_blk, 1, w_off]
        refs = {"eager": rope_latent(q_pe, kv_a, cos, sin, w, 1e-6, rank, interleave),
                "compiled": compiled(q_pe, kv_a, cos, sin, w, 1e-6, rank, interleave)}
        q32, l32 = rope_latent(q_pe.float(), kv_a.float(), cos.float(), sin.float(), w.float(), 1e-6, rank,
                               interleave)
        refs["float32 once"] = (q32.bfloat16(), l32.bfloat16())
        for name, (rq, rl) in refs.items():
            print(f"T={t} H={h} interleave={interleave} kernel vs {name}: q differs {(q != rq).float().mean():.4f}, "
                  f"k_pe {(lat[:, rank:] != rl[:, rank:]).float().mean():.4f}, "
                  f"norm {(lat[:, :rank] != rl[:, :rank]).float().mean():.4f}", flush=True)
        eq, el = refs["eager"]
        cq, cl = refs["compiled"]
        print(f"T={t} eager vs compiled: q differs {(eq != cq).float().mean():.4f}, "
              f"norm {(el[:, :rank] != cl[:, :rank]).float().mean():.4f}", flush=True)


if __name__ == "__main__":
    main()
