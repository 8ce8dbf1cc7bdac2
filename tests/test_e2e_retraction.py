"""Capacity end to end (real etcd, gRPC on loopback, NIXL): a decode worker whose KV pool is
sized from --mem-fraction-static and deliberately too small for its concurrent requests
retracts some and re-prefills them, and every stream still equals `reference_generate`
(greedy and seeded sampling) with no block left behind; a worker's admission queue holds
requests beyond the practical capacity and refuses one more with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.grpc_server import channel
from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, frontend_pb2, frontend_pb2_grpc, sampling_pb2
from common.sampling_params import SamplingParams
from engine.capacity import module_bytes
from engine.reference import reference_generate
from engine.sampling import sample
from harness import InProcessCluster

pytestmark = pytest.mark.e2e
POOL_BLOCKS, BLOCK = 20, 16
N, MAX_TOKENS = 6, 60


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model, one_torch_thread):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-retract")
    cfg = tiny_model.config
    block_bytes = BLOCK * cfg.kv_dim * cfg.num_kv_layers * 4  # float32 pool (MTP layer included)
    # Device memory such that 0.5 of it minus the weights holds POOL_BLOCKS (and a half) blocks.
    memory = int((module_bytes(tiny_model.model) + (POOL_BLOCKS + 0.5) * block_bytes) / 0.5)
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    # practical_fraction 4 overcommits on purpose: all N requests are admitted, the pool cannot
    # hold them at full length, so the decode loop must retract.
    c.decode = c.start("decode", num_blocks=0, mem_fraction_static=0.5, device_memory_bytes=memory,
                       practical_fraction=4.0)
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


def prompt(i: int) -> list[int]:
    return [(97 * i + 13 * j) % 150000 + 1 for j in range(20 + 7 * i)]


def sampling(i: int) -> sampling_pb2.SamplingParams:
    if i == N - 1:  # one seeded sampling stream: its random steps must survive retraction
        return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=11)
    return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def reference(model, i: int) -> list[int]:
    s = sampling(i)
    if s.HasField("temperature"):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=s.temperature, seed=s.seed, ignore_eos=True)
        return reference_generate(model.model, prompt(i), MAX_TOKENS,
                                  sample_fn=lambda row, step: sample(row, params, step)[0])
    return reference_generate(model.model, prompt(i), MAX_TOKENS)


def settled(cluster, rt) -> bool:
    """No block referenced, no reservation, nothing retracted or queued on the decode worker."""
    def check():
        sched_adm = rt_admission(cluster)
        return (rt.pool.blocks.num_free == rt.pool.config.num_blocks and sched_adm.reserved == 0
                and sched_adm.admitted == 0 and sched_adm.held == 0 and sched_adm.queued == 0)
    deadline = time.time() + 15
    while not cluster.on_loop(check):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def rt_admission(cluster):
    return cluster.decode.runtime.scheduler.admission


def test_pool_sized_from_mem_fraction(cluster):
    rt = cluster.decode.runtime
    assert rt.pool.config.num_blocks == POOL_BLOCKS
    assert rt.instance("x").kv_capacity_blocks == POOL_BLOCKS  # the discovery record says so too


def test_forced_retraction_gives_reference_tokens_and_leaks_nothing(cluster, tiny_model):
    rt = cluster.decode.runtime
    before = rt.stats.retractions

    async def storm():
        async with channel(cluster.router.address) as ch:
            stub = frontend_pb2_grpc.FrontendServiceStub(ch)

            async def one(i):
                out = []
                async for msg in stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompt(i), sampling=sampling(i)),
                                               timeout=120):
                    out += msg.token_ids
                return out

            return await asyncio.gather(*(one(i) for i in range(N)))

    results = asyncio.run(storm())
    assert rt.stats.retractions > before, "the pool was meant to be too small: no retraction happened"
    for i, got in enumerate(results):
        assert got == reference(tiny_model, i), f"stream {i} differs after retraction"
    assert settled(cluster, rt), "blocks or reservations left behind"


def test_admission_queues_then_refuses_beyond_the_bound(cluster, tiny_model):
    # A worker outside discovery (etcd=""), called directly: 16 blocks, budget 8, one queue slot.
    h = cluster.start("decode", etcd="", num_blocks=16, practical_fraction=0.5, max_queued=1)
    adm = h.runtime.scheduler.admission
    a_prompt, b_prompt = [5] * 20, [6] * 20

    async def rest(call) -> list[int]:
        out: list[int] = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            out += msg.token_ids
        return out

    async def main():
        async with channel(h.address) as ch:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)

            def call(tokens, n):
                return stub.Generate(decode_pb2.DecodeRequest(
                    token_ids=tokens, sampling=sampling_pb2.SamplingParams(max_tokens=n, ignore_eos=True)), timeout=60)

            a = call(a_prompt, 100)  # projects 8 blocks: the whole budget
            a_out = list((await a.read()).token_ids)
            b = call(b_prompt, 10)  # 2 more blocks do not fit: queued
            while adm.queued != 1:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call([7] * 20, 10).read()  # queue full: refused at once
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.value.details()
            assert time.monotonic() - start < 5
            return a_out + await rest(a), await rest(b)

    try:
        a_out, b_out = cluster.call(main(), timeout=120)
        assert a_out == reference_generate(tiny_model.model, a_prompt, 100)
        assert b_out == reference_generate(tiny_model.model, b_prompt, 10)
        assert adm.waited >= 1
        deadline = time.time() + 10
        while cluster.on_loop(lambda: (adm.admitted, h.runtime.pool.blocks.num_free)) != (0, 16):
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        cluster.stop(h)


def test_cancellations_under_retraction_leave_nothing_behind(cluster, tiny_model):
    """Streams cancelled while running, retracted or re-prefilling free everything; the rest finish exactly."""
    rt = cluster.decode.runtime

    async def storm():
        async with channel(cluster.router.address) as ch:
            stub = frontend_pb2_grpc.FrontendServiceStub(ch)

            async def one(i):
                call = stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompt(i), sampling=sampling(i)),
                                     timeout=120)
                out: list[int] = []
                try:
                    async for msg in call:
                        out += msg.token_ids
                        if i % 2 and len(out) >= 10 + 9 * i:  # odd streams go away part-way
                            return None
                    return out
                finally:
                    call.cancel()

            return await asyncio.gather(*(one(i) for i in range(N + 2)))

    results = asyncio.run(storm())
    for i, got in enumerate(results):
        if got is not None:
            assert got == reference(tiny_model, i), f"stream {i} differs"
    assert settled(cluster, rt), "blocks or reservations left behind"
