"""Prefill workers failing during transfers (separate processes, small KV pools so a leaked
block would show): kill -9, and SIGSTOP for longer than the deadlines then SIGCONT. Every
request completes with the reference tokens, and afterwards a request that needs nearly the
whole decode pool still fits (no leak). A burst of over-long prompts leaves the workers healthy."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import frontend_pb2, sampling_pb2
from engine.model_source import TINY
from engine.reference import reference_generate

pytestmark = pytest.mark.e2e
BLOCKS = 128


def prompt(i: int, n: int = 200) -> list[int]:
    return [(97 * i + 13 * j) % 150000 + 1 for j in range(n)]


async def run_all(stub, prompts, max_tokens=6):
    async def one(p):
        out = []
        async for msg in stub.Generate(frontend_pb2.GenerateRequest(
                token_ids=p, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens)), timeout=120):
            out += msg.token_ids
        return out
    return await asyncio.gather(*(one(p) for p in prompts))


async def fences_released(cluster: LocalCluster, timeout_s: float = 60.0) -> None:
    """Wait until the decode worker holds no block (the fenced ones returned)."""
    from tests.test_e2e_stuck import scrape
    decode = next(a for i, a in cluster.metrics_addresses().items() if i.startswith("decode"))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (used := (await asyncio.to_thread(scrape, decode))["tandem_worker_kv_used_blocks"]) > 0:
        assert loop.time() < deadline, f"{used} decode blocks still held {timeout_s} s after the failures"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("chaos", ["kill-9", "sigstop"])
def test_prefill_worker_failing_during_transfers(tiny_model, tmp_path, chaos):
    prompts = [prompt(i) for i in range(6)]

    async def main():
        cluster = LocalCluster(model=TINY, namespace=f"e2e-prefill-{chaos}", num_prefill=2, log_dir=str(tmp_path),
                               metrics=True,
                               worker_args=["--num-blocks", str(BLOCKS), "--prefill-timeout", "3",
                                            "--transfer-timeout", "3"])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            try:
                # Stalled before the router's probes notice: requests still go there. With kill-9
                # the stalled process is then killed with those calls open: the tiny model's
                # prefills take milliseconds, so a kill timed after the requests were sent found
                # them all finished in 4 of 6 runs and the decode worker never lost one.
                cluster.procs["prefill-0"].send_signal(signal.SIGSTOP)
                work = asyncio.create_task(run_all(stub, prompts))
                if chaos == "kill-9":
                    await asyncio.sleep(0.3)  # calls routed to prefill-0 are open on it
                    cluster.stop_process("prefill-0", signal.SIGKILL)
                results = await work
                if chaos == "sigstop":
                    await asyncio.sleep(4)  # past the prefill and transfer deadlines
                    cluster.procs["prefill-0"].send_signal(signal.SIGCONT)
                    results += await run_all(stub, [prompt(50 + i) for i in range(4)])
                # Blocks fenced after the failed calls come back once the failed worker answers
                # Abandon or its port refuses (decode_worker/fence.py); then the pool is empty.
                await fences_released(cluster)
                # Nearly the whole decode pool: fits only if no block leaked.
                big = prompt(99, n=(BLOCKS - 2) * 16 - 8)
                tail = await run_all(stub, [big], max_tokens=4)
                # Over-long prompts, a burst: clear errors, nobody's health suffers.
                over = [stub.Generate(frontend_pb2.GenerateRequest(token_ids=[1] * 5000), timeout=10)
                        for _ in range(30)]
                for call in over:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in call:
                            pass
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                after = await run_all(stub, [prompt(77, n=20)])
                return results, tail, after
            finally:
                await ch.close()

    results, tail, after = asyncio.run(main())
    # The decode worker really lost prefills to the failure and prefilled those prompts itself.
    assert "prefilling locally" in (tmp_path / "decode-0.log").read_text()
    expected = [prompt(i) for i in range(6)] + ([prompt(50 + i) for i in range(4)] if chaos == "sigstop" else [])
    for p, got in zip(expected, results):
        assert got == reference_generate(tiny_model.model, p, 6, tiny_model.config.eos_token_ids)
    assert len(tail[0]) >= 1 and len(after[0]) >= 1
