"""Client channels' keepalive (common/grpc_server.py): a call to a server that stopped answering
(SIGSTOP: its kernel keeps the TCP connection open) fails with UNAVAILABLE within
keepalive time + timeout, not grpc's own 60 s PING-ack wait."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import grpc_server as gs

ROOT = Path(__file__).resolve().parent.parent
SERVER = r"""
import asyncio
from common.grpc_server import start_server
async def main():
    s = await start_server("127.0.0.1:0", [], [])
    print(s.port, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_a_stopped_server_fails_calls_within_the_keepalive_bound(monkeypatch) -> None:
    monkeypatch.setattr(gs, "KEEPALIVE", gs.Keepalive(1.0, 1.0))
    proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        async def main() -> tuple[float, grpc.StatusCode]:
            async with gs.channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)  # connected and serving
                os.kill(proc.pid, signal.SIGSTOP)
                t0 = time.monotonic()
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=45)
                except grpc.aio.AioRpcError as exc:
                    return time.monotonic() - t0, exc.code()
                raise AssertionError("a stopped server answered")

        took, code = asyncio.run(main())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert code == grpc.StatusCode.UNAVAILABLE, code
    assert took < 15, f"failed after {took:.1f} s; keepalive 1 s + 1 s (grpc's default PING-ack wait is 60 s)"
