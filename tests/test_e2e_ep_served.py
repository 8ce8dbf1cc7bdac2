"""An expert-parallel decode worker through the served path `tandem up` runs: router, prefill
worker and a decode worker of two EP ranks (`[decode] ep_size = 2` in the config file the
cluster hands its children), as separate processes over loopback gRPC with mutual TLS. The
prefill worker writes each request's KV through the transfer agent of the rank that owns it
(the decode worker's record lists the rank agents), and every answer is reference_generate's."""

from __future__ import annotations

import pytest

from common.pb.tandem.v1 import discovery_pb2
from engine.reference import reference_generate
from harness import serve_at_once

pytestmark = pytest.mark.e2e


def test_tandem_up_with_an_ep_decode_worker(tiny_model, tmp_path, monkeypatch):
    config = tmp_path / "tandem.toml"
    config.write_text('[decode]\nep_size = 2\ntorch_threads = 1\n\n[prefill]\ntorch_threads = 1\n')
    monkeypatch.setenv("TANDEM_CONFIG", str(config))  # what `tandem up --config FILE` does
    vocab = tiny_model.config.vocab_size
    prompts = [[(3000 + 211 * r + 17 * i) % vocab for i in range(24 + 5 * r)] for r in range(6)]

    results, metrics, records, codes = serve_at_once(prompts, 6, namespace="e2e-ep-served",
                                                     log_dir=str(tmp_path / "logs"), worker_args=["--num-blocks", "256"])
    decode, metrics = records[discovery_pb2.ROLE_DECODE], metrics[discovery_pb2.ROLE_DECODE]
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_generate(tiny_model.model, p, 6, tiny_model.config.eos_token_ids)
    assert [a.capacity_blocks for a in decode.rank_transfer_agents] == [256]  # rank 1's agent, its own pool
    assert decode.kv_capacity_blocks == 2 * 256
    # every prompt's KV came from the prefill worker (none prefilled on the decode worker)
    assert metrics["tandem_worker_remote_prefills_total"] == len(prompts)
    assert metrics["tandem_worker_local_prefills_total"] == 0
    assert all(code == 0 for code in codes.values()), codes  # a clean drain, EP ranks included
