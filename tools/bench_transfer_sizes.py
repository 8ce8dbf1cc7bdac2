"""KV transfer bandwidth by size and block size, per-transfer cost, transfers/s (issue 10).

A child process owns the destination pool (a `SelectingAgent("auto")` offers every backend it
has); this process owns the source pool and, per backend, an agent forced to that backend.
Pools are uint8 [num_blocks, block_bytes] with block_bytes = block_tokens x --bytes-per-token
(default 35,136 B: DeepSeek-R1's MLA latent in FP8, docs/bench/capacity.md), so a 16-token block
is 562 kB and a 64-token block 2.25 MB. For every size (1 MB ... 1 GB), block size and backend,
a write of the first size/block_bytes blocks into the child's pool, with a notification, is
timed at the writer (submission to notification sent), interleaved in each round with the
copy limit of the same bytes in this process:

  host (--device cpu):  memcpy, torch `copy_` on 1 thread and on all torch threads
  GPU  (--device cuda): device-to-device `copy_` in one process (synchronised)

Reported: median GB/s (1e9 B/s) over --repeats rounds (one warm-up round dropped) and the
median of per-round ratios backend / copy. Then, per backend, the fixed cost of a small
transfer (one 4 KiB block, notified) in microseconds and transfers per second, sequential and
with 16 in flight.

Usage:
  python tools/bench_transfer_sizes.py --device cpu --backends nixl,shm --out docs/bench/x.json
  python tools/bench_transfer_sizes.py --device cuda --backends cuda-ipc --out /tmp/x.json
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

from kv_transfer import PoolDescriptor, create_agent, prepare_pool  # noqa: E402

TIMEOUT_S = 120.0
SMALL_BYTES = 4096
MB = 1_000_000


def _pool(nbytes: int, block_bytes: int, device: str, fill: int) -> torch.Tensor:
    t = torch.full((nbytes // block_bytes, block_bytes), fill, dtype=torch.uint8, device=device)
    prepare_pool(t, "auto")
    return t


def _child(conn, layouts: list[tuple[str, int, int]], device: str) -> None:
    """Destination pools (one per layout name), each behind an auto agent, until "stop".
    Notifications are left buffered (bounded): the writer's timing ends when it sent them."""
    pools = {name: _pool(nbytes, bb, device, 0) for name, nbytes, bb in layouts}
    agents = {name: create_agent("auto", f"bench-D-{name}") for name in pools}
    conn.send({name: (tuple(agents[name].register_pool(pools[name])), agents[name].metadata())
               for name in pools})
    conn.recv()
    for a in agents.values():
        a.close()


class Writer:
    """One forced-backend agent writing into one of the child's pools."""

    def __init__(self, backend: str, layout: str, src: torch.Tensor, desc, metadata) -> None:
        self.agent = create_agent(backend, f"bench-P-{backend}-{layout}")
        self.agent.register_pool(src)
        self.agent.add_peer(f"bench-D-{layout}", metadata)
        self.peer, self.desc, self.n = f"bench-D-{layout}", PoolDescriptor(*desc), 0

    async def write(self, num_blocks: int) -> float:
        ids = list(range(num_blocks))
        msg = f"n{self.n}".encode()
        self.n += 1
        result = await self.agent.write_blocks(self.peer, ids, self.desc.blocks(ids), msg, TIMEOUT_S)
        return result.seconds


def _copy_s(src: torch.Tensor, dst: torch.Tensor, threads: int | None) -> float:
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if src.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(saved)


async def _fixed_cost(w: Writer, count: int) -> dict[str, float]:
    lat = [await w.write(1) for _ in range(count)]
    t0 = time.perf_counter()
    for _ in range(count):
        await w.write(1)
    seq = count / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(max(1, count // 16)):
        await asyncio.gather(*(w.write(1) for _ in range(16)))
    conc = 16 * max(1, count // 16) / (time.perf_counter() - t0)
    return {"latency_us_median": statistics.median(lat) * 1e6, "latency_us_p99": sorted(lat)[int(0.99 * (len(lat) - 1))] * 1e6,
            "transfers_per_s_sequential": seq, "transfers_per_s_16_in_flight": conc}


def run(args: argparse.Namespace) -> dict:
    sizes = [int(s * MB) for s in args.sizes_mb]
    max_bytes = max(sizes)
    layouts = [(f"b{bt}", max_bytes + bt * args.bytes_per_token, bt * args.bytes_per_token)
               for bt in args.block_tokens]
    layouts.append(("small", SMALL_BYTES * 64, SMALL_BYTES))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there, layouts, args.device), daemon=True)
    child.start()
    if not here.poll(300):
        raise RuntimeError(f"child did not start (exit code {child.exitcode})")
    info = here.recv()
    srcs = {name: _pool(nbytes, bb, args.device, 1) for name, nbytes, bb in layouts}
    scratch = torch.zeros(max_bytes, dtype=torch.uint8, device=args.device)
    flat = {name: t.view(-1) for name, t in srcs.items()}
    writers = {(b, name): Writer(b, name, srcs[name], *info[name]) for b in args.backends for name, _, _ in layouts}
    limits = ["d2d copy"] if args.device == "cuda" else list(dict.fromkeys(
        ["memcpy 1-thread", f"memcpy {torch.get_num_threads()}-thread"]))
    rows = []

    async def rounds() -> None:
        for name, _, bb in layouts[:-1]:
            seen = set()
            for size in sizes:
                nb = max(1, size // bb)
                if nb in seen:  # a size below one block: measured once, as one block
                    continue
                seen.add(nb)
                nbytes = nb * bb
                samples: dict[str, list[float]] = {k: [] for k in [*limits, *args.backends]}
                for r in range(args.repeats + 1):
                    s = {}
                    for lim in limits:
                        threads = 1 if lim == "memcpy 1-thread" else None  # else torch's setting
                        s[lim] = _copy_s(flat[name][:nbytes], scratch[:nbytes], threads)
                    for b in args.backends:
                        s[b] = await writers[(b, name)].write(nb)
                    if r:
                        for k, v in s.items():
                            samples[k].append(v)
                gbps = {k: statistics.median(nbytes / x / 1e9 for x in v) for k, v in samples.items()}
                ratio = {f"{b} / {lim}": statistics.median(lt / bt_ for lt, bt_ in zip(samples[lim], samples[b]))
                         for b in args.backends for lim in limits}
                rows.append({"block_tokens": int(name[1:]), "block_bytes": bb, "bytes": nbytes, "blocks": nb,
                             "gbps": gbps, "ratio": ratio})
                print(f"{name:>4} {nbytes / MB:>9.1f} MB " + "  ".join(f"{k} {v:7.2f}" for k, v in gbps.items())
                      + "  | " + "  ".join(f"{k} {v:.2f}" for k, v in ratio.items()), flush=True)

    async def small() -> dict:
        return {b: await _fixed_cost(writers[(b, "small")], args.small_count) for b in args.backends}

    try:
        asyncio.run(rounds())
        fixed = asyncio.run(small())
        for b, f in fixed.items():
            print(f"small {SMALL_BYTES} B {b}: " + "  ".join(f"{k} {v:.1f}" for k, v in f.items()), flush=True)
    finally:
        for w in writers.values():
            w.agent.close()
        here.send("stop")
        child.join(30)
        if child.is_alive():
            child.kill()
    return {"device": args.device, "backends": args.backends, "bytes_per_token": args.bytes_per_token,
            "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "bandwidth": rows, "small_transfers": fixed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--backends", default="", help="comma list; default nixl,shm on cpu, cuda-ipc on cuda")
    ap.add_argument("--sizes-mb", default="1,4,16,64,256,1024", help="transfer sizes, 1e6 B")
    ap.add_argument("--block-tokens", default="16,64")
    ap.add_argument("--bytes-per-token", type=int, default=35_136)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small-count", type=int, default=200, help="small transfers per measurement")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads: the memcpy baseline's and the shm copy's")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    args.backends = [b for b in args.backends.split(",") if b] or (
        ["cuda-ipc"] if args.device == "cuda" else ["nixl", "shm"])
    args.sizes_mb = [float(s) for s in args.sizes_mb.split(",")]
    args.block_tokens = [int(s) for s in args.block_tokens.split(",")]
    results = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
