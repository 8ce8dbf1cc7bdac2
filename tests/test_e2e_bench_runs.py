"""`tandem bench` against real workers over loopback (plaintext gRPC): requests longer than
the model's context left out before the run (counted on stderr) or sent and refused with
--over-context send, and a run stopped with Ctrl-C still reporting the requests that finished
(its table, its --out JSON, exit status 130); the workers' --profile-dir window written while
they serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.cluster import LocalCluster
from engine.model_source import TINY

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


PROFILES = "profiles"  # under the cluster's log folder: --profile-dir of both workers


@pytest.fixture(scope="module")
def up(etcd_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-logs")
    cluster = LocalCluster(model=TINY, etcd=etcd_server.endpoint, namespace="e2e-bench-runs", tls=False,
                           worker_args=["--num-blocks", "256", "--profile-dir", str(logs / PROFILES),
                                        "--profile-calls", "40:3"], log_dir=str(logs))
    cluster.profiles = logs / PROFILES
    asyncio.run(cluster.start())
    yield cluster
    asyncio.run(cluster.stop())


def _bench(up, *args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", "bench", "--router", up.router_address, *args]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}


def test_requests_longer_than_the_context_are_left_out_or_sent_and_refused(up, tmp_path):
    # the shipped Mooncake slice's rows 16 and 17: 915 and 12,846 prompt tokens; tandem-tiny's
    # context is 4,096 tokens
    rows = ("--skip", "16", "--num-requests", "2", "--max-output-len", "4", "--arrival", "concurrency")
    out = tmp_path / "skip.json"
    r = subprocess.run(_bench(up, *rows, "--out", str(out)), cwd=ROOT, capture_output=True, text=True,
                       timeout=180, env=_env())
    assert r.returncode == 0 and "interrupted" not in r.stderr + r.stdout, r.stderr
    assert "left out 1 of 2 requests whose prompt + output exceed the model's context (4096 tokens" in r.stderr
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"], summary["left_out_over_context"]) == (1, 0, 1), summary
    sent = subprocess.run(_bench(up, *rows, "--over-context", "send"), cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=_env())
    assert sent.returncode == 1 and "left out" not in sent.stderr, sent.stderr
    assert "INVALID_ARGUMENT" in sent.stdout and "context length is 4096" in sent.stdout, sent.stdout
    # none fits: said before anything is sent, with what to do
    none = subprocess.run(_bench(up, "--skip", "17", "--num-requests", "1"), cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env=_env())
    assert none.returncode != 0 and "every request of --dataset mooncake has a prompt + output longer than the " \
        "model's context (4096 tokens)" in none.stderr and "--over-context send" in none.stderr, none.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_reports_the_requests_that_finished(up, tmp_path, sig):
    # SIGTERM (`timeout`, a job's stop) ends a run as Ctrl-C does; the exit status tells them apart
    out = tmp_path / "interrupted.json"
    cmd = _bench(up, "--dataset", "synthetic-prefix", "--groups", "2", "--prefix-len", "16", "--suffix-len", "16",
                 "--num-requests", "2000", "--output-tokens", "4", "--arrival", "concurrency", "--concurrency", "2",
                 "--out", str(out))
    with subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as p:
        try:
            started = ""
            deadline = time.monotonic() + 120
            while "2000 requests" not in started and time.monotonic() < deadline:
                started = p.stderr.readline()
                assert started or p.poll() is None, p.communicate()
            time.sleep(6)  # some requests finish
            assert p.poll() is None, p.communicate()
            p.send_signal(sig)
            stdout, stderr = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert p.returncode == 128 + sig and "Traceback" not in stderr, stderr
    assert "Serving Benchmark Result (interrupted)" in stdout and "interrupted after" in stderr, (stdout, stderr)
    doc = json.loads(out.read_text())
    done = doc["summary"]["completed"]
    assert doc["summary"]["interrupted"] and doc["summary"]["requests_planned"] == 2000
    assert doc["summary"]["signal"] == signal.Signals(sig).name
    assert 0 < done < 2000 and len(doc["requests"]) == done + doc["summary"]["failed"], doc["summary"]


def test_each_worker_writes_its_profile_window_while_serving(up):
    # --profile-calls 40:3: calls 41..43 of each worker's model thread (the runs above made more)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(up.profiles.glob("*.summary.json"))) < 2:
        subprocess.run([sys.executable, "-m", "cli.main", "generate", "To be", "--max-tokens", "8", "--router",
                        up.router_address], cwd=ROOT, capture_output=True, timeout=60, env=_env())
    summaries = sorted(p.name.split("-")[0] for p in up.profiles.glob("*.summary.json"))
    assert summaries == ["decode", "prefill"], list(up.profiles.iterdir())
    for path in up.profiles.glob("*.summary.json"):
        doc = json.loads(path.read_text())
        assert doc["calls"] == 3 and doc["first_call"] == 41 and doc["wall_s"] > 0, doc
        assert path.with_name(path.name.replace(".summary.json", ".trace.json.gz")).stat().st_size > 0
