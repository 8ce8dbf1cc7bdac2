"""NIXL's UCX listeners stay on the worker's --host interface (kv_transfer/ucx_bind.py): a real
NIXL agent in a fresh process, its listening TCP sockets read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_transfer.ucx_bind import confine_ucx, interface_of

ROOT = Path(__file__).resolve().parent.parent

_PROBE = r"""
import os, sys, time
from kv_transfer.ucx_bind import confine_ucx
confine_ucx(sys.argv[1])
from kv_transfer.nixl_backend import NixlAgent
agent = NixlAgent("probe")
time.sleep(0.5)
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
for line in open("/proc/net/tcp").read().splitlines()[1:]:
    f = line.split()
    if f[3] == "0A" and f[9] in inodes:  # LISTEN
        ip = bytes.fromhex(f[1].split(":")[0])[::-1]
        print("LISTEN", ".".join(str(b) for b in ip))
"""


def _listeners(host: str, env: dict[str, str]) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _PROBE, host], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return [line.split()[1] for line in r.stdout.splitlines() if line.startswith("LISTEN ")]


def test_loopback_host_keeps_ucx_on_loopback() -> None:
    pytest.importorskip("nixl_cu13", reason="nixl-cu13 not installed")
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    got = _listeners("127.0.0.1", env)
    assert got, "the agent listened nowhere: the probe reads nothing"
    assert all(ip.startswith("127.") for ip in got), got


def test_interface_lookup_and_operator_setting_wins(monkeypatch) -> None:
    assert interface_of("127.0.0.1") == "lo" and interface_of("localhost") == "lo"
    assert interface_of("203.0.113.77") is None  # no interface carries it
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert confine_ucx("0.0.0.0") is None and "UCX_NET_DEVICES" not in os.environ
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    assert confine_ucx("127.0.0.1") == "eth9"
    monkeypatch.delenv("UCX_NET_DEVICES")
    assert confine_ucx("127.0.0.1") == "lo" and os.environ["UCX_NET_DEVICES"] == "lo"
