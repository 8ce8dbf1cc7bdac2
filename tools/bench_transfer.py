"""Benchmark KV block transfer bandwidth against a plain memcpy (docs/bench/transfer.md).

Two pools of `--total-mb / 2` MB each (default 268 MB in all, as in docs/bench/transfer.md); every block of
the source pool is written into a destination pool:

  memcpy           dst.copy_(src) in this process: the copy bandwidth limit (torch's threads)
  memcpy 1-thread  the same on one thread (UCX's intra-host copy, CMA, runs on one thread)
  nixl 1-process   NIXL WRITE between two agents of this process (blocks merge: 1 descriptor)
  nixl scattered   same, destination blocks shuffled so nothing merges (one descriptor a block)
  nixl 2-process   NIXL WRITE into a pool owned by a spawned child process

Each round runs every path once, so a noisy shared machine affects all paths alike; after one
warm-up round (the first NIXL transfer pays ~20 ms of connection setup) `--repeats` rounds are
timed. Reported: median GB/s (1e9 B/s), timed from submission to completion at the writer, and
the median over rounds of NIXL / memcpy in the same round.

Usage: python tools/bench_transfer.py [--total-mb 268] [--blocks 256] [--repeats 10]
       [--progress-delay-us 1000] [--json PATH]
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

from kv_transfer import PoolDescriptor  # noqa: E402
from kv_transfer.nixl_backend import NixlAgent  # noqa: E402

TIMEOUT_S = 60.0
PATHS = ("memcpy", "memcpy 1-thread", "nixl 1-process", "nixl scattered", "nixl 2-process")


def _memcpy(src: torch.Tensor, dst: torch.Tensor, threads: int) -> float:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(saved)


def _child(conn, num_blocks: int, block_floats: int, rounds: int, delay_us: int) -> None:
    """Destination pool in its own process: receives `rounds` writes, reports a checksum."""
    dst = torch.zeros(num_blocks, block_floats)
    with NixlAgent("bench-D-child", delay_us) as d:
        desc = d.register_pool(dst)  # before metadata(): it describes registered memory
        conn.send((d.metadata(), tuple(desc)))

        async def receive():
            for i in range(rounds):
                await d.wait_notification(f"child-{i}".encode(), TIMEOUT_S)
        asyncio.run(receive())
        conn.send(float(dst.double().sum()))


async def _write(p: NixlAgent, peer: str, desc: PoolDescriptor, src_ids, dst_ids, msg: bytes,
                 receiver: NixlAgent | None) -> float:
    waiter = asyncio.ensure_future(receiver.wait_notification(msg, TIMEOUT_S)) \
        if receiver else None
    result = await p.write_blocks(peer, src_ids, desc.blocks(dst_ids), msg, TIMEOUT_S)
    if waiter:
        await waiter
    return result.seconds


def run(num_blocks: int, block_floats: int, repeats: int, delay_us: int) -> dict[str, list]:
    """Seconds per path and round (warm-up round dropped)."""
    src = torch.randn(num_blocks, block_floats)
    local_dst = torch.zeros_like(src)
    scratch = torch.zeros_like(src)
    ids = list(range(num_blocks))
    shuffled = torch.randperm(num_blocks).tolist()
    rounds = repeats + 1
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there, num_blocks, block_floats, rounds, delay_us))
    child.start()
    times: dict[str, list] = {k: [] for k in PATHS}
    try:
        if not here.poll(TIMEOUT_S):
            raise RuntimeError(f"child did not start (exit code {child.exitcode})")
        child_md, child_desc = here.recv()
        with NixlAgent("bench-P", delay_us) as p, NixlAgent("bench-D", delay_us) as d:
            p.register_pool(src)
            d_desc = d.register_pool(local_dst)
            p.add_peer("bench-D", d.metadata())
            p.add_peer("bench-D-child", child_md)
            child_desc = PoolDescriptor(*child_desc)

            async def rounds_():
                for i in range(rounds):
                    sample = {
                        "memcpy": _memcpy(src, scratch, torch.get_num_threads()),
                        "memcpy 1-thread": _memcpy(src, scratch, 1),
                        "nixl 1-process": await _write(p, "bench-D", d_desc, ids, ids,
                                                       f"in-{i}".encode(), d),
                        "nixl scattered": await _write(p, "bench-D", d_desc, ids, shuffled,
                                                       f"sc-{i}".encode(), d),
                        "nixl 2-process": await _write(p, "bench-D-child", child_desc, ids,
                                                       ids, f"child-{i}".encode(), None),
                    }
                    if i:  # round 0 is the warm-up
                        for k, v in sample.items():
                            times[k].append(v)
            asyncio.run(rounds_())
            if not torch.equal(local_dst[shuffled], src):
                raise RuntimeError("in-process destination differs from the source")
            if not here.poll(TIMEOUT_S) or here.recv() != float(src.double().sum()):
                raise RuntimeError("the child's destination differs from the source")
    finally:
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=float, default=268, help="both pools together, 1e6 B")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per pool")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds")
    ap.add_argument("--progress-delay-us", type=int, default=1000,
                    help="UCX progress thread wake-up period (0 = busy-spin a core per agent)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    block_floats = max(1, int(args.total_mb * 1e6 / 2) // args.blocks // 4)
    nbytes = args.blocks * block_floats * 4
    times = run(args.blocks, block_floats, args.repeats, args.progress_delay_us)

    gbps = {k: [nbytes / s / 1e9 for s in v] for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in gbps.items()}
    ratio = {k: statistics.median(g / m for g, m in zip(v, gbps["memcpy"]))
             for k, v in gbps.items()}
    print(f"pool {nbytes / 1e6:.1f} MB x 2, {args.blocks} blocks of "
          f"{nbytes / args.blocks / 1e3:.1f} kB, {args.repeats} rounds, torch threads "
          f"{torch.get_num_threads()}, progress delay {args.progress_delay_us} us")
    print(f"{'path':<17}{'median GB/s':>12}{'min':>8}{'max':>8}{'/ memcpy':>10}")
    for k, v in gbps.items():
        print(f"{k:<17}{median[k]:>12.2f}{min(v):>8.2f}{max(v):>8.2f}{ratio[k]:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "pool_bytes": nbytes, "blocks": args.blocks, "repeats": args.repeats,
            "progress_delay_us": args.progress_delay_us, "median_gbps": median,
            "ratio_to_memcpy": ratio, "samples_gbps": gbps}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
