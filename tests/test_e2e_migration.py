"""A decode worker lost while 50 streams run on two decode workers — kill -9 (the router
migrates its streams) or SIGTERM (it drains them) — and every stream completes with exactly the
tokens a fault-free run gives (greedy, and seeded sampling); no client sees an error."""

from __future__ import annotations

import asyncio
import signal

import pytest

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import frontend_pb2, sampling_pb2
from common.sampling_params import SamplingParams
from engine.model_source import TINY
from engine.reference import reference_generate
from engine.sampling import sample
from decode_helpers import reference_draws

pytestmark = pytest.mark.e2e
N, MAX_TOKENS = 50, 24


def sampling(i: int) -> sampling_pb2.SamplingParams:
    if i % 4 == 3:  # a quarter sample with a seed
        return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, seed=1000 + i)
    if i % 4 == 1:  # a quarter with penalties: the new worker counts the tokens generated before it too
        return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=-1.5,
                                           frequency_penalty=-0.5, temperature=0.7 if i % 8 == 1 else 0.0, seed=i)
    return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm-drain"])
def test_decode_worker_lost_mid_stream_every_stream_completes_exactly(tiny_model, tmp_path, sig):
    prompts = [[(31 * i + 7 * j) % 150000 + 1 for j in range(10 + i)] for i in range(N)]

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-migrate", num_decode=2, log_dir=str(tmp_path))
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            started = asyncio.Event()
            counts = [0] * N

            async def one(i):
                out = []
                async for msg in stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompts[i], sampling=sampling(i)),
                                               timeout=120):
                    out += msg.token_ids
                    counts[i] = len(out)
                    if all(c >= 2 for c in counts):
                        started.set()
                return out

            tasks = [asyncio.create_task(one(i)) for i in range(N)]
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.to_thread(cluster.stop_process, "decode-0", sig, 60.0)
            try:
                return await asyncio.gather(*tasks), list(counts)
            finally:
                await ch.close()

    results, _ = asyncio.run(main())
    for i, got in enumerate(results):
        s = sampling(i)
        if s.HasField("presence_penalty"):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=s.temperature, seed=s.seed, ignore_eos=True,
                                    presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty)
            ref = reference_draws(tiny_model.model, prompts[i], MAX_TOKENS, params)
        elif s.HasField("temperature"):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=s.temperature, seed=s.seed, ignore_eos=True)
            ref = reference_generate(tiny_model.model, prompts[i], MAX_TOKENS,
                                     sample_fn=lambda row, step, p=params: sample(row, p, step)[0])
        else:
            ref = reference_generate(tiny_model.model, prompts[i], MAX_TOKENS)
        assert got == ref, f"stream {i} differs"


def test_migration_trial_script_on_cpu_is_exact(tmp_path):
    """tools/bench_migration_gpu.py (the GPU exactness trial) on a CPU in float32: runs B and C
    (decode-0 killed, its streams migrated) give run A's tokens exactly, greedy and seeded."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "migration.json"
    r = subprocess.run([sys.executable, "tools/bench_migration_gpu.py", "--device", "cpu", "--model", "tandem-tiny",
                        "--streams", "8", "--max-tokens", "16", "--kill-after", "4", "--out", str(out)],
                       cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["lengths_ok"] and res["migrated_streams"] >= 1
    for run in ("B_vs_A", "C_vs_A"):
        for kind in ("greedy", "seeded"):
            assert res[run][kind]["identical_stream_share"] == 1.0, (run, kind, res[run][kind])
