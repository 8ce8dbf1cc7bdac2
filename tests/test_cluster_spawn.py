"""`tandem up`'s child command lines (cli/cluster.py LocalCluster.spawn), without starting them."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import pytest

from cli.cluster import LocalCluster, _hold_port


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


def test_mocker_processes_split_the_simulated_workers(monkeypatch, tmp_path):
    seen: dict[str, list[str]] = {}

    class FakePopen:
        def __init__(self, cmd, **kwargs) -> None:
            seen[kwargs["stdout"].name.rsplit("/", 1)[-1]] = cmd

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    c = LocalCluster(num_mocker=10, mocker_processes=3, log_dir=str(tmp_path), etcd="127.0.0.1:1",
                     mocker_args=["--speedup", "4"])
    c._spawn_workers()
    counts = {name: int(cmd[cmd.index("--num-workers") + 1]) for name, cmd in seen.items()}
    assert counts == {"mocker.log": 4, "mocker-1.log": 3, "mocker-2.log": 3}
    assert all(cmd[-2:] == ["--speedup", "4"] for cmd in seen.values())
    with pytest.raises(ValueError, match="--mocker-processes"):
        LocalCluster(num_mocker=2, mocker_processes=3, log_dir=str(tmp_path))


def test_replicas_refuse_a_port_something_already_serves(tmp_path):
    """Replicas bind with SO_REUSEPORT: on a port where another cluster's router listens (also
    with SO_REUSEPORT) they would join it silently; tandem up refuses the port instead."""
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    held: list[socket.socket] = []
    try:
        with pytest.raises(OSError, match=f"--http-port {port} is in use"):
            _hold_port(held, port, "--http-port")
        c = LocalCluster(num_routers=2, router_port=port, log_dir=str(tmp_path), tls=False)
        with pytest.raises(OSError, match=f"--port {port} is in use"):
            asyncio.run(c.start())
        assert c.procs == {} and c._etcd is None  # nothing was started
        other.close()
        assert _hold_port(held, port) == port  # free again: held for the replicas
    finally:
        other.close()
        for s in held:
            s.close()


def test_a_port_left_in_time_wait_is_not_in_use():
    """A stopped router's connections linger in TIME_WAIT on its port for a minute: tandem up
    on the same port right after must not call that in use (the routers bind with SO_REUSEADDR)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection stays in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    held: list[socket.socket] = []
    try:
        assert _hold_port(held, port) == port
    finally:
        for s in held:
            s.close()
