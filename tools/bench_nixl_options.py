"""NIXL/UCX options on one host, host memory: READ vs WRITE, descriptor lists, UCX workers.

One NIXL agent here (source pool), one in a spawned child (destination pool); the child's
memory is written (WRITE) and read back (READ) by this process, the whole pool split into
SPLIT descriptor lists (one transfer handle each, posted back to back), with NW UCX workers.
Each round also times `copy_` of the same bytes on 2 threads and on 1 thread; the medians of
5 rounds (one warm-up dropped) are printed with the ratios. UCX options go in the environment
(e.g. UCX_TLS=tcp,cma; UCX_TLS=posix,sysv,tcp; UCX_RNDV_THRESH=inf). Results:
docs/bench/transfer.md.

Usage: MB=128 SPLIT=1 NW=1 [UCX_...=...] python tools/bench_nixl_options.py
"""

import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import torch

MB = int(os.environ.get("MB", "128"))
SPLIT = int(os.environ.get("SPLIT", "1"))
NW = os.environ.get("NW", "1")


def make_agent(name: str):
    """A NIXL agent as kv_transfer/nixl_backend.py builds it (progress thread, 1 ms delay)."""
    import nixl_cu13._api as api
    import nixl_cu13._bindings as bind
    w = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    cfg = bind.nixlAgentConfig()
    cfg.useProgThread, cfg.useListenThread, cfg.syncMode = True, False, bind.NIXL_THREAD_SYNC_NONE
    cfg.pthrDelay, cfg.lthrDelay, cfg.captureTelemetry = 1000, 100000, False
    w.agent = bind.nixlAgent(name, cfg)
    w.create_backend("UCX", {"num_workers": NW})
    return w


def child(conn) -> None:
    t = torch.zeros(MB * 1000 * 1000 // 4)
    a = make_agent("child")
    a.register_memory(t)
    conn.send((bytes(a.get_agent_metadata()), t.data_ptr()))
    conn.recv()


def descs(a, base: int, n: int, parts: int):
    step = n // parts
    return [a.get_xfer_descs(np.array([[base + i * step, step, 0]], dtype=np.uint64), "DRAM")
            for i in range(parts)]


def main() -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=child, args=(there,))
    proc.start()
    md, rbase = here.recv()
    src = torch.randn(MB * 1000 * 1000 // 4)
    scratch = torch.zeros_like(src)
    a = make_agent("parent")
    a.register_memory(src)
    a.add_remote_agent(md)
    n = src.numel() * 4
    res: dict[str, list[float]] = {k: [] for k in ["memcpy2", "memcpy1", "WRITE", "READ"]}
    for r in range(6):
        for th in (2, 1):
            torch.set_num_threads(th)
            t0 = time.perf_counter()
            scratch.copy_(src)
            if r:
                res[f"memcpy{th}"].append(time.perf_counter() - t0)
        for op in ("WRITE", "READ"):
            hs = [a.initialize_xfer(op, lo, rm, "child", b"")
                  for lo, rm in zip(descs(a, src.data_ptr(), n, SPLIT), descs(a, rbase, n, SPLIT))]
            t0 = time.perf_counter()
            for h in hs:
                a.transfer(h)
            while any(a.check_xfer_state(h) == "PROC" for h in hs):
                pass
            dt = time.perf_counter() - t0
            for h in hs:
                a.release_xfer_handle(h)
            if r:
                res[op].append(dt)
    here.send(0)
    proc.join()
    m2, m1 = statistics.median(res["memcpy2"]), statistics.median(res["memcpy1"])
    print(f"MB={MB} SPLIT={SPLIT} NW={NW} UCX_TLS={os.environ.get('UCX_TLS', '')}: " + "  ".join(
        f"{k} {n / statistics.median(v) / 1e9:.2f} GB/s ({m2 / statistics.median(v):.2f}x memcpy2, "
        f"{m1 / statistics.median(v):.2f}x memcpy1)" for k, v in res.items()))


if __name__ == "__main__":
    main()
