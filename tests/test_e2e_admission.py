"""Admission against what cannot fit, with real processes (`tandem up`'s LocalCluster: etcd,
router, prefill and decode workers, mutual TLS, loopback; issue 20): a request whose prompt +
max_tokens exceeds the decode pool is refused at once with RESOURCE_EXHAUSTED naming the
numbers while normal requests keep flowing; a request that fits only alone does not hold the
requests behind it for its whole run: after its turn (--solo-wait) it is retracted, they run,
and it resumes with exactly the tokens it gives when nothing else runs. Nothing is left behind."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc
import pytest

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, sampling_pb2
from engine.model_source import TINY
from engine.reference import reference_generate

pytestmark = pytest.mark.e2e
# 64 blocks of 16 tokens; a budget of 16 blocks (--practical-fraction 0.25): a request of more
# than 256 tokens (prompt + max_tokens) runs only alone, one of more than 1024 never fits.
POOL, FRACTION, SOLO_WAIT = 64, 0.25, 1.0
SOLO = dict(prompt=[(7 * j) % 9000 + 5 for j in range(20)], max_tokens=1000)  # 64 blocks: alone
SMALL_MAX = 16


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


def small_prompt(i: int) -> list[int]:
    return [(31 * i + 3 * j) % 9000 + 1 for j in range(6)]


def test_oversized_refused_at_once_and_a_lone_request_yields_its_turn(tiny_model, tmp_path):
    solo_sampling = sampling_pb2.SamplingParams(max_tokens=SOLO["max_tokens"], ignore_eos=True, temperature=0.9,
                                                seed=7)

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-admission", log_dir=str(tmp_path), metrics=True,
                               worker_args=["--num-blocks", str(POOL), "--practical-fraction", str(FRACTION),
                                            "--solo-wait", str(SOLO_WAIT)])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            decode_metrics = next(a for i, a in cluster.metrics_addresses().items()
                                  if cluster.instances[i].role == discovery_pb2.ROLE_DECODE)

            async def stream(prompt: list[int], s: sampling_pb2.SamplingParams, stamps: list[float] | None = None):
                out: list[int] = []
                async for msg in stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompt, sampling=s),
                                               timeout=180):
                    out += msg.token_ids
                    if stamps is not None:
                        stamps.append(time.monotonic())
                return out

            def small(i: int) -> sampling_pb2.SamplingParams:
                return sampling_pb2.SamplingParams(max_tokens=SMALL_MAX, ignore_eos=True)

            # 1. Beyond the whole pool: refused at once, while three normal requests stream.
            flowing = [asyncio.create_task(stream(small_prompt(i), small(i))) for i in range(3)]
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stream([9] * 20, sampling_pb2.SamplingParams(max_tokens=1100, ignore_eos=True))
            refused_in = time.monotonic() - start
            normal = await asyncio.gather(*flowing)

            # 2. The lone request alone: the fault-free tokens.
            alone = await stream(SOLO["prompt"], solo_sampling)
            yields0 = scrape(decode_metrics)["tandem_worker_solo_yields_total"]

            # 3. The same request, with small ones arriving once it streams.
            solo_stamps: list[float] = []
            solo = asyncio.create_task(stream(SOLO["prompt"], solo_sampling, solo_stamps))
            while len(solo_stamps) < 5:
                await asyncio.sleep(0.01)
            sent = time.monotonic()
            small_stamps: list[list[float]] = [[] for _ in range(3)]
            behind = await asyncio.gather(*(stream(small_prompt(10 + i), small(i), small_stamps[i]) for i in range(3)))
            smalls_done = time.monotonic()
            contended = await solo
            m = scrape(decode_metrics)
            deadline = time.monotonic() + 20
            while m["tandem_worker_kv_used_blocks"] or m["tandem_worker_requests_in_flight"]:
                assert time.monotonic() < deadline, "blocks or requests left behind"
                await asyncio.sleep(0.2)
                m = scrape(decode_metrics)
            await ch.close()
            return (e.value, refused_in, normal, alone, contended, behind, sent, smalls_done, solo_stamps,
                    m["tandem_worker_solo_yields_total"] - yields0)

    (err, refused_in, normal, alone, contended, behind, sent, smalls_done, solo_stamps,
     yields) = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "prompt (20 tokens) + max_tokens (1100) needs 70 KV blocks" in err.details(), err.details()
    assert f"whole pool has {POOL} blocks" in err.details(), err.details()
    assert refused_in < 5, f"refused after {refused_in:.1f} s"
    for i, got in enumerate(normal):
        assert got == reference_generate(tiny_model.model, small_prompt(i), SMALL_MAX)
    for i, got in enumerate(behind):
        assert got == reference_generate(tiny_model.model, small_prompt(10 + i), SMALL_MAX)
    assert contended == alone and len(alone) == SOLO["max_tokens"]  # retracted and resumed: the same tokens
    assert yields >= 1
    # They waited about one turn (--solo-wait, at least 1 s), not for the whole lone request.
    assert smalls_done < solo_stamps[-1], "the small requests waited for the lone one to finish"
    assert smalls_done - sent < 3 * max(SOLO_WAIT, 1.0) + 5, f"small requests took {smalls_done - sent:.1f} s"
