"""An expert-parallel decode worker through the served path `tandem up` runs: router, prefill
worker and a decode worker of two EP ranks (`[decode] ep_size = 2` in the config file the
cluster hands its children), as separate processes over loopback gRPC with mutual TLS. The
prefill worker writes each request's KV through the transfer agent of the rank that owns it
(the decode worker's record lists the rank agents), and every answer is reference_generate's."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.client import frontend_stub, generate
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import discovery_pb2
from engine.model_source import TINY
from engine.reference import reference_generate

pytestmark = pytest.mark.e2e


def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:  # summed over labels (a counter may carry the worker's labels)
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_tandem_up_with_an_ep_decode_worker(tiny_model, tmp_path, monkeypatch):
    config = tmp_path / "tandem.toml"
    config.write_text('[decode]\nep_size = 2\ntorch_threads = 1\n\n[prefill]\ntorch_threads = 1\n')
    monkeypatch.setenv("TANDEM_CONFIG", str(config))  # what `tandem up --config FILE` does
    vocab = tiny_model.config.vocab_size
    prompts = [[(3000 + 211 * r + 17 * i) % vocab for i in range(24 + 5 * r)] for r in range(6)]

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-ep-served", metrics=True, log_dir=str(tmp_path / "logs"),
                               worker_args=["--num-blocks", "256"])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            try:
                results = await asyncio.gather(*(generate(stub, token_ids=p, max_tokens=6, timeout_s=120)
                                                 for p in prompts))
            finally:
                await ch.close()
            decode = next(i for i in cluster.instances.values() if i.role == discovery_pb2.ROLE_DECODE)
            metrics = await asyncio.to_thread(_scrape, decode.metrics_address)
        return results, decode, metrics, {name: proc.returncode for name, proc in cluster.procs.items()}

    results, decode, metrics, codes = asyncio.run(main())
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_generate(tiny_model.model, p, 6, tiny_model.config.eos_token_ids)
    assert [a.capacity_blocks for a in decode.rank_transfer_agents] == [256]  # rank 1's agent, its own pool
    assert decode.kv_capacity_blocks == 2 * 256
    # every prompt's KV came from the prefill worker (none prefilled on the decode worker)
    assert metrics["tandem_worker_remote_prefills_total"] == len(prompts)
    assert metrics["tandem_worker_local_prefills_total"] == 0
    assert all(code == 0 for code in codes.values()), codes  # a clean drain, EP ranks included
