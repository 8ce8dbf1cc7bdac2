"""Benchmark KV block transfer bandwidth against a plain memcpy (DESIGN.md section 5).

Two pools of `--total-mb / 2` MB each (default 268 MB in all, as in DESIGN.md); every block of
the source pool is written into the destination pool:

  memcpy          dst.copy_(src) in one process: the copy bandwidth limit
  nixl 1-process  NIXL WRITE between two agents in this process (blocks merged: 1 descriptor)
  nixl scattered  same, blocks in shuffled order so nothing merges (per-descriptor overhead)
  nixl 2-process  NIXL WRITE into a pool owned by a spawned child process

Each is repeated `--repeats` times after one warm-up (the first NIXL transfer pays connection
setup); the median is reported in GB/s (1e9 bytes/s), timed from submission to completion at
the writer. Usage: python tools/bench_transfer.py [--total-mb 268] [--repeats 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from kv_transfer import PoolDescriptor, create_agent  # noqa: E402

TIMEOUT_S = 60.0


def _pool(num_blocks: int, block_floats: int, fill: float | None) -> torch.Tensor:
    if fill is None:
        return torch.randn(num_blocks, block_floats)
    return torch.full((num_blocks, block_floats), fill)


def bench_memcpy(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> list[float]:
    dst.copy_(src)  # warm-up: page faults
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    return out


async def _writes(p, peer: str, desc: PoolDescriptor, src_ids, dst_ids, repeats: int,
                  receiver=None) -> list[float]:
    out = []
    for i in range(repeats + 1):
        msg = f"bench-{i}".encode()
        waiter = asyncio.create_task(receiver.wait_notification(msg, TIMEOUT_S)) if receiver \
            else None
        result = await p.write_blocks(peer, src_ids, desc.blocks(dst_ids), msg, TIMEOUT_S)
        if waiter:
            await waiter
        if i:  # 0 is the warm-up
            out.append(result.seconds)
    return out


def bench_in_process(src: torch.Tensor, repeats: int, scattered: bool) -> list[float]:
    n = src.shape[0]
    dst = torch.zeros_like(src)
    with create_agent("nixl", "bench-P") as p, create_agent("nixl", "bench-D") as d:
        p.register_pool(src)
        desc = d.register_pool(dst)
        p.add_peer("bench-D", d.metadata())
        ids = list(range(n))
        dst_ids = torch.randperm(n).tolist() if scattered else ids
        out = asyncio.run(_writes(p, "bench-D", desc, ids, dst_ids, repeats, receiver=d))
        assert torch.equal(dst[dst_ids], src), "destination differs from source"
    return out


def _child(conn, num_blocks: int, block_floats: int, repeats: int) -> None:
    dst = _pool(num_blocks, block_floats, 0.0)
    dst.fill_(0)  # touch the pages before timing
    with create_agent("nixl", "bench-D-child") as d:
        conn.send((d.metadata(), tuple(d.register_pool(dst))))

        async def receive():
            for i in range(repeats + 1):
                await d.wait_notification(f"bench-{i}".encode(), TIMEOUT_S)
        asyncio.run(receive())
        conn.send(float(dst.double().sum()))


def bench_two_processes(src: torch.Tensor, repeats: int) -> list[float]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there, src.shape[0], src.shape[1], repeats))
    child.start()
    try:
        metadata, desc = here.recv()
        with create_agent("nixl", "bench-P-parent") as p:
            p.register_pool(src)
            p.add_peer("bench-D-child", metadata)
            ids = list(range(src.shape[0]))
            out = asyncio.run(_writes(p, "bench-D-child", PoolDescriptor(*desc), ids, ids,
                                      repeats))
            if not here.poll(TIMEOUT_S):
                raise RuntimeError("child did not confirm")
            assert here.recv() == float(src.double().sum()), "child's pool differs"
    finally:
        child.join(TIMEOUT_S)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=float, default=268, help="both pools together, 1e6 B")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per pool")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    pool_bytes = int(args.total_mb * 1e6 / 2)
    block_floats = max(1, pool_bytes // args.blocks // 4)
    src = _pool(args.blocks, block_floats, None)
    nbytes = src.numel() * src.element_size()
    runs = {"memcpy": bench_memcpy(src, torch.zeros_like(src), args.repeats)}
    runs["nixl 1-process"] = bench_in_process(src, args.repeats, scattered=False)
    runs["nixl scattered"] = bench_in_process(src, args.repeats, scattered=True)
    runs["nixl 2-process"] = bench_two_processes(src, args.repeats)

    gbps = {k: [nbytes / s / 1e9 for s in v] for k, v in runs.items()}
    median = {k: statistics.median(v) for k, v in gbps.items()}
    print(f"pool {nbytes / 1e6:.1f} MB x 2, {args.blocks} blocks of "
          f"{nbytes // args.blocks / 1e3:.1f} kB, {args.repeats} repeats, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'path':<16}{'median GB/s':>12}{'min':>8}{'max':>8}{'/ memcpy':>10}")
    for k, v in gbps.items():
        print(f"{k:<16}{median[k]:>12.2f}{min(v):>8.2f}{max(v):>8.2f}"
              f"{median[k] / median['memcpy']:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "pool_bytes": nbytes, "blocks": args.blocks, "repeats": args.repeats,
            "median_gbps": median, "samples_gbps": gbps,
            "ratio_to_memcpy": {k: median[k] / median["memcpy"] for k in median},
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
