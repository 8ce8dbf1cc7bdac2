"""`tandem up`'s child command lines (cli/cluster.py LocalCluster.spawn), without starting them."""

from __future__ import annotations

import subprocess

from cli.cluster import LocalCluster


def test_metrics_port_goes_to_real_workers_only(monkeypatch, tmp_path):
    seen: dict[str, list[str]] = {}

    class FakePopen:  # records the command line instead of starting a process
        def __init__(self, cmd, **kwargs) -> None:
            seen[cmd[3]] = cmd

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    c = LocalCluster(metrics=True, log_dir=str(tmp_path), etcd="127.0.0.1:1")
    for role in ("router", "prefill", "decode", "mocker"):
        c.spawn(role, role)
    assert all("--metrics-port" in seen[r] for r in ("router", "prefill", "decode"))
    assert "--metrics-port" not in seen["mocker"]  # simulated workers have no /metrics (it would not parse)
