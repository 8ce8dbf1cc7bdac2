"""A prefill worker stopped mid-transfer whose call the decode worker's keepalive fails (the
transport's UNAVAILABLE, before the call's deadline): the decode worker must fence the blocks it
gave that worker, as after a deadline, or the resumed worker's pending writes land in blocks a
later request reuses. Default --prefill-timeout (30 s), so the keepalive (10 + 5 s) fires first."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc

import pytest

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from decode_worker.service import FENCE_WAIT_S
from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, sampling_pb2
from engine.model_source import TINY
from engine.reference import reference_generate
from tests.test_e2e_stuck import INTERVAL, THRESHOLD, TIMEOUT, prefill_in_rotation, scrape, stopped

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("resume", [True, False], ids=["resumed", "still-stopped"])
def test_keepalive_failure_of_a_stopped_prefill_worker_fences_its_blocks(tiny_model, tmp_path, monkeypatch, resume):
    # still-stopped: the fence holds b's blocks for its whole bound (2 × (30 + 10) s); b must not
    # wait that long: after FENCE_WAIT_S the decode worker refuses it, RESOURCE_EXHAUSTED
    a = [(41 * j + 7) % 150000 + 1 for j in range(600)]
    b = [(53 * j + 5) % 150000 + 1 for j in range(1850)]  # needs a's blocks (128-block pools)
    monkeypatch.setenv("TANDEM_TEST_STOP_AFTER_WRITES", "2")  # the prefill worker stops itself mid-transfer

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-keepalive-fence", log_dir=str(tmp_path), metrics=True,
                               worker_args=["--num-blocks", "128", "--transfer-timeout", "10"],
                               router_args=["--health-interval", str(INTERVAL), "--health-timeout", str(TIMEOUT),
                                            "--health-failure-threshold", str(THRESHOLD)])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            metrics = cluster.metrics_addresses()
            decode_id = next(i for i, inst in cluster.instances.items() if inst.role == discovery_pb2.ROLE_DECODE)
            pid = cluster.procs["prefill-0"].pid

            async def generate(prompt, max_tokens):
                out = []
                async for msg in stub.Generate(frontend_pb2.GenerateRequest(
                        token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                        timeout=120):
                    out += msg.token_ids
                return out

            got_a = await generate(a, 4)  # its prefill call fails by keepalive; a is prefilled locally
            assert stopped(pid)
            fenced = scrape(metrics[decode_id])["tandem_worker_fenced_prefills_total"]
            await prefill_in_rotation(stub, False)
            task_b = asyncio.create_task(generate(b, 48))
            if not resume:
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await task_b
                os.kill(pid, signal.SIGCONT)
                await ch.close()
                return got_a, fenced, (err.value.code(), time.monotonic() - t0)
            await asyncio.sleep(3)
            os.kill(pid, signal.SIGCONT)  # its pending writes may now run: they must not reach b's blocks
            got_b = await task_b
            await ch.close()
            return got_a, fenced, got_b

    try:
        got_a, fenced, got_b = asyncio.run(main())
    finally:
        for line in (tmp_path / "decode-0.log").read_text().splitlines():
            if "prefilling locally" in line:
                print(line)
    model = tiny_model.model
    assert got_a == reference_generate(model, a, 4)
    assert fenced >= 1, "the call failed unanswered (UNAVAILABLE) but nothing was fenced"
    if not resume:
        code, waited = got_b
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and waited < FENCE_WAIT_S + 10, (code, waited)
        return
    assert got_b == reference_generate(model, b, 48), "a late write of the resumed prefill worker reached b's blocks"
