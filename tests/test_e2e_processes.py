"""The local cluster as separate processes (what `tandem up` and `make demo` run): a real
etcd child process, router, prefill and decode workers, all over loopback gRPC and NIXL."""

from __future__ import annotations

import asyncio

import pytest

from cli.client import frontend_stub, generate
from cli.cluster import LocalCluster
from engine.model_source import TINY
from engine.reference import reference_generate

pytestmark = pytest.mark.e2e


def test_twenty_concurrent_streams_complete_and_match_reference(tiny_model, tmp_path):
    prompts = [f"Question {i}: explain the number {i * 37} in a few words." for i in range(20)]

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-procs", worker_args=["--num-blocks", "1024"], log_dir=str(tmp_path))
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            try:
                results = await asyncio.gather(*(generate(stub, text=p, max_tokens=8, timeout_s=120) for p in prompts))
            finally:
                await ch.close()
        return results, {name: proc.returncode for name, proc in cluster.procs.items()}

    results, codes = asyncio.run(main())
    assert all(code == 0 for code in codes.values()), codes  # one SIGTERM each: a clean drain, exit 0
    tok = tiny_model.tokenizer()
    assert len(results) == 20
    for p, r in zip(prompts, results):
        assert r.finish_reason in ("length", "eos")
        assert r.token_ids == reference_generate(tiny_model.model, tok.encode(p), 8, tiny_model.config.eos_token_ids)
