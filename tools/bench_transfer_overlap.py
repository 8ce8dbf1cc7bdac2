"""Exposed KV transfer time after prefill, with and without overlap (issue 10).

This process is a prefill worker's runtime (`WorkerRuntime`: the real chunk loop on its model
thread, the real pool and transfer agent); a child process holds a decode worker's pool and
agent. For each prompt length and mode, a fresh prompt is prefilled in chunks and its blocks
sent with `ChunkSender` — overlapped (each chunk's finished blocks written while the next
chunk computes) or not (everything after the prefill, one write) — and the child records when
the notification arrives. Exposed time = notification arrival at the child − end of the last
prefill chunk (CLOCK_MONOTONIC is shared by the processes of one host). It includes the last
token's logits (both modes alike; reported apart). Target: with overlap ≤ the transfer time of one chunk,
which is measured alongside (one chunk's blocks written alone).

The model is the tiny DeepSeek-V3 config widened to a DeepSeek-sized MLA latent
(kv_lora_rank 512 + rope 64 per layer, float32), so a chunk's compute and its KV both matter.

Usage: python tools/bench_transfer_overlap.py [--prompts 8192,32768] [--chunk-size 2048]
       [--backend auto] [--layers 4] [--repeats 2] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from common.pb.tandem.v1 import discovery_pb2  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.model import build_model  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from worker.host import WorkerOptions, WorkerRuntime  # noqa: E402
from kv_transfer import PoolDescriptor, create_agent, prepare_pool  # noqa: E402
from prefill_worker.chunk_sender import ChunkSender  # noqa: E402

TIMEOUT_S = 3600.0


def _config(layers: int, max_len: int) -> ModelConfig:
    return dataclasses.replace(ModelConfig.tiny(), vocab_size=2048, bos_token_id=0, eos_token_id=(1,), num_hidden_layers=layers, kv_lora_rank=512,
                               qk_rope_head_dim=64, max_position_embeddings=max_len + 16)


def _child(conn, shape: tuple[int, ...], backend: str, messages: list[str]) -> None:
    """Decode side: the pool and agent; reports each notification's arrival (monotonic s)."""
    pool = torch.zeros(shape)
    prepare_pool(pool, backend)
    agent = create_agent(backend, "overlap-D")
    conn.send((tuple(agent.register_pool(pool)), agent.metadata()))

    async def receive() -> dict[str, float]:
        arrivals = {}
        for m in messages:
            await agent.wait_notification(m.encode(), TIMEOUT_S)
            arrivals[m] = time.monotonic()
        return arrivals
    conn.send(asyncio.run(receive()))
    conn.recv()  # the writer's last measurement still targets this pool
    agent.close()


async def one(rt: WorkerRuntime, peer: str, desc: PoolDescriptor, n: int, seed: int, overlap: bool,
              msg: str) -> dict[str, float]:
    tokens = torch.randint(0, rt.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompt = rt.pool.allocate_prompt(tokens)
    assert prompt.num_cached_blocks == 0
    dst = desc.blocks(list(range(len(prompt.block_ids))))
    sender = ChunkSender(rt.agent, peer, prompt.block_ids, 0, dst, rt.pool.block_size, TIMEOUT_S, overlap=overlap)
    marks: dict[str, float] = {}

    async def on_chunk_done(done: int) -> None:
        if done == n:
            marks["last_chunk_end"] = time.monotonic()
        await sender.on_chunk_done(done)
    try:
        t0 = time.monotonic()
        await rt.prefill(prompt.block_ids, tokens, 0, on_chunk_done=on_chunk_done)
        marks["logits_s"] = time.monotonic() - marks["last_chunk_end"]
        result = await sender.finish(msg.encode())
        marks["sent"] = time.monotonic()
        marks["prefill_s"] = marks["last_chunk_end"] - t0
        marks["bytes"] = result.bytes
        marks["writes"] = result.writes
        # One chunk's transfer alone, for the target (same blocks again: no compute running).
        k = min(rt.opts.chunk_size // rt.pool.block_size, len(prompt.block_ids))
        one_chunk = await rt.agent.write_blocks(peer, prompt.block_ids[:k], desc.blocks(list(range(k))), None, TIMEOUT_S)
        marks["one_chunk_transfer_s"] = one_chunk.seconds
    finally:
        await sender.aclose()
        rt.pool.free(prompt.block_ids)
    return marks


def run(args: argparse.Namespace) -> dict:
    prompts = [int(p) for p in args.prompts.split(",")]
    cfg = _config(args.layers, max(prompts))
    blocks = -(-max(prompts) // args.block_size) + 1
    opts = WorkerOptions(model="bench-overlap", block_size=args.block_size, num_blocks=blocks,
                         chunk_size=args.chunk_size, transfer_backend=args.backend, torch_threads=args.torch_threads)
    loaded = LoadedModel("bench-overlap", cfg, build_model(cfg, seed=0).eval(), None)
    rt = WorkerRuntime(discovery_pb2.ROLE_PREFILL, opts, loaded)
    plan = [(n, overlap, r) for r in range(args.repeats) for n in prompts for overlap in (True, False)]
    messages = [f"{n}-{'on' if o else 'off'}-{r}" for n, o, r in plan]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there, tuple(rt.pool.kv.shape), args.backend, messages), daemon=True)
    child.start()
    try:
        if not here.poll(120):
            raise RuntimeError("child did not start")
        desc, metadata = here.recv()
        rt.agent.add_peer("overlap-D", metadata)
        backend = rt.agent.backend_for("overlap-D")

        async def all_runs() -> list[dict[str, float]]:
            out = []
            for i, ((n, o, _), m) in enumerate(zip(plan, messages)):
                out.append(await one(rt, "overlap-D", PoolDescriptor(*desc), n, 100 + i, o, m))
                print(f"  {m}: prefill {out[-1]['prefill_s']:.2f} s", flush=True)
            return out
        marks = asyncio.run(all_runs())
        if not here.poll(TIMEOUT_S):
            raise RuntimeError("child did not report")
        arrivals = here.recv()
        here.send("bye")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        rt.close()
    rows = []
    for n in prompts:
        for overlap in (True, False):
            ms = [(mk, arrivals[m]) for (pn, o, _), m, mk in zip(plan, messages, marks) if pn == n and o == overlap]
            exposed = [arr - mk["last_chunk_end"] for mk, arr in ms]
            rows.append({"prompt_tokens": n, "overlap": overlap, "backend": backend,
                         "exposed_s": statistics.median(exposed),
                         "one_chunk_transfer_s": statistics.median(mk["one_chunk_transfer_s"] for mk, _ in ms),
                         "prefill_s": statistics.median(mk["prefill_s"] for mk, _ in ms),
                         "logits_s": statistics.median(mk["logits_s"] for mk, _ in ms),
                         "chunks": -(-n // args.chunk_size), "writes": ms[0][0]["writes"],
                         "kv_bytes": int(ms[0][0]["bytes"])})
            r = rows[-1]
            print(f"{n:>6} tokens overlap {'on ' if overlap else 'off'} {backend}: exposed {r['exposed_s'] * 1e3:8.1f} ms"
                  f" (last logits {r['logits_s'] * 1e3:.1f} ms)  one chunk's transfer {r['one_chunk_transfer_s'] * 1e3:7.1f} ms  prefill {r['prefill_s']:6.2f} s"
                  f"  {r['chunks']} chunks, {r['writes']} writes, KV {r['kv_bytes'] / 1e6:.0f} MB", flush=True)
    return {"backend": backend, "layers": args.layers, "chunk_size": args.chunk_size, "block_size": args.block_size,
            "bytes_per_token": rt.pool.config.bytes_per_token, "repeats": args.repeats,
            "torch_threads": args.torch_threads, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="8192,32768", help="prompt lengths in tokens")
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--backend", default="auto", help="auto | nixl | shm (host pools)")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    results = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
