"""The router against workers that misbehave without dying (issue 20), in one process with a
real etcd and real gRPC over loopback: a departed worker's address is never dialled again (by
the router, nor by a decode worker that dialled a prefill worker); a
stream that goes silent past --token-stall-timeout moves to another worker, with the router's
own deadline on every call when the client sets none; a request that cannot fit any decode
pool is refused at once, naming the numbers, while other requests keep flowing."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest

from common.block_hash import hash_seed
from common.grpc_server import start_server
from common.pb.tandem.v1 import (decode_pb2, decode_pb2_grpc, discovery_pb2, frontend_pb2, frontend_pb2_grpc,
                                 prefill_pb2_grpc, sampling_pb2)
from discovery.registration import Registration
from engine.reference import reference_generate
from harness import InProcessCluster
from worker.session import SessionMixin

pytestmark = pytest.mark.e2e
HEALTH_S = 0.2  # router health interval and probe timeout in these tests


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-lifecycle")
    yield c
    c.close()


def record(c: InProcessCluster, instance_id: str, address: str, capacity: int = 512) -> Registration:
    inst = discovery_pb2.Instance(instance_id=instance_id, role=discovery_pb2.ROLE_DECODE, address=address,
                                  model=c.loaded.name, block_size=c.worker_opts.block_size,
                                  hash_seed=hash_seed(c.loaded.name, weights=c.loaded.fingerprint),
                                  weights_fingerprint=c.loaded.fingerprint, state=discovery_pb2.INSTANCE_STATE_SERVING,
                                  kv_capacity_blocks=capacity)
    return Registration(c.etcd, c.namespace, inst, ttl_seconds=5)


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def counting_listener(port: int = 0) -> tuple[socket.socket, list[float]]:
    """A TCP listener on `port` (0: a free one) that accepts and closes at once (it speaks no
    HTTP/2, so every gRPC call or probe to it fails), and the monotonic times of the
    connections it accepted."""
    listener = socket.create_server(("127.0.0.1", port))
    accepts: list[float] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepts.append(time.monotonic())
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, accepts


def test_departed_workers_address_gets_no_connection(cluster):
    router = cluster.start("router", health_interval_s=HEALTH_S, health_timeout_s=HEALTH_S)
    listener, accepts = counting_listener()
    reg = record(cluster, "decode-departs", f"127.0.0.1:{listener.getsockname()[1]}")
    try:
        cluster.call(reg.start())
        wait(lambda: accepts, 10, "the router never dialled the registered worker")
        cluster.call(reg.stop())  # revokes the lease: the record is gone
        wait(lambda: "decode-departs" not in router.workers.instance_ids(), 10, "record still in the router's view")
        time.sleep(3 * 1.0 + 2 * HEALTH_S)  # past gRPC's reconnect back-off (1 s) and ten probe rounds
        gone_at = time.monotonic()
        time.sleep(2.0)
        assert [t for t in accepts if t > gone_at] == [], "the router dialled a departed worker's address"
        assert router.workers.channel_count() == 0 and router.workers.channels_closed >= 1
    finally:
        listener.close()
        cluster.stop(router)


class RefusingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Answers every Prefill with RESOURCE_EXHAUSTED: an answer, so the decode worker fences
    nothing (decode_worker/service.py ANSWERED) and prefills locally."""

    def __init__(self) -> None:
        self.calls = 0

    async def Prefill(self, request, context):
        self.calls += 1
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")


def test_decode_workers_channel_to_a_departed_prefill_worker_is_closed(cluster, tiny_model):
    """A decode worker keeps one channel per prefill worker in discovery and closes it once the
    record is gone (with churn they would pile up); a later request naming the departed
    address is prefilled locally without a connection to it."""
    decode = cluster.start("decode")
    fake = RefusingPrefill()
    server = cluster.call(start_server("127.0.0.1:0", [lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(
        fake, s)], ["tandem.v1.PrefillService"]))
    address = f"127.0.0.1:{server.port}"
    inst = discovery_pb2.Instance(instance_id="prefill-departs", role=discovery_pb2.ROLE_PREFILL, address=address,
                                  model=cluster.loaded.name, block_size=cluster.worker_opts.block_size,
                                  weights_fingerprint=cluster.loaded.fingerprint,
                                  state=discovery_pb2.INSTANCE_STATE_SERVING)
    reg = Registration(cluster.etcd, cluster.namespace, inst, ttl_seconds=5)
    prompt = [41, 42, 43, 44]
    listener = None
    try:
        cluster.call(reg.start())
        with grpc.insecure_channel(decode.address) as ch:
            got = [t for m in decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(
                request_id="dials-prefill", token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=4),
                prefill_address=address), timeout=60) for t in m.token_ids]
        assert got == reference_generate(tiny_model.model, prompt, 4, tiny_model.config.eos_token_ids)
        assert fake.calls == 1  # it was dialled, refused, and the decode worker prefilled locally
        open_channels = decode.runtime.metrics.prefill_channels_fn
        assert cluster.on_loop(open_channels) == 1
        cluster.call(reg.stop())  # revokes the lease: the record is gone
        wait(lambda: cluster.on_loop(open_channels) == 0, 10, "the channel to the departed prefill worker stayed open")
        assert decode.runtime.stats.prefill_channels_closed == 1
        # Nothing dials the port afterwards: a request naming it is prefilled locally, unconnected.
        cluster.call(server.stop(0))
        listener, accepts = counting_listener(server.port)
        with grpc.insecure_channel(decode.address) as ch:
            got = [t for m in decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(
                request_id="dials-departed", token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=4),
                prefill_address=address), timeout=60) for t in m.token_ids]
        assert got == reference_generate(tiny_model.model, prompt, 4, tiny_model.config.eos_token_ids)
        time.sleep(1.0)
        assert accepts == [], "the decode worker dialled a departed prefill worker's address"
        assert cluster.on_loop(open_channels) == 0
    finally:
        if listener is not None:
            listener.close()
        cluster.stop(decode)


def test_request_queued_while_its_prefill_worker_leaves_does_not_dial_it(cluster, tiny_model):
    """A request checked against discovery may then wait in admission (seconds, minutes). If
    its prefill worker's record leaves meanwhile, the decode worker closes the channel; the
    request, once admitted, must prefill locally, not open a new channel to the departed
    address (one that would outlive the record: nothing would close it again)."""
    decode = cluster.start("decode")
    fake = RefusingPrefill()
    server = cluster.call(start_server("127.0.0.1:0", [lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(
        fake, s)], ["tandem.v1.PrefillService"]))
    address = f"127.0.0.1:{server.port}"
    inst = discovery_pb2.Instance(instance_id="prefill-leaves-queued", role=discovery_pb2.ROLE_PREFILL,
                                  address=address, model=cluster.loaded.name,
                                  block_size=cluster.worker_opts.block_size,
                                  weights_fingerprint=cluster.loaded.fingerprint,
                                  state=discovery_pb2.INSTANCE_STATE_SERVING)
    reg = Registration(cluster.etcd, cluster.namespace, inst, ttl_seconds=5)
    prompt = [51, 52, 53, 54]
    admission = decode.runtime.scheduler.admission
    open_channels = decode.runtime.metrics.prefill_channels_fn
    held = False

    def generate(request_id: str) -> list[int]:
        with grpc.insecure_channel(decode.address) as ch:
            return [t for m in decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(
                request_id=request_id, token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=4),
                prefill_address=address), timeout=60) for t in m.token_ids]

    try:
        cluster.call(reg.start())
        want = reference_generate(tiny_model.model, prompt, 4, tiny_model.config.eos_token_ids)
        assert generate("dials-it") == want and fake.calls == 1 and cluster.on_loop(open_channels) == 1
        cluster.on_loop(admission.hold)  # the next request waits in admission
        held = True
        result: list = []
        caller = threading.Thread(target=lambda: result.append(generate("queued")), daemon=True)
        caller.start()
        wait(lambda: cluster.on_loop(lambda: admission.queued) == 1, 10, "the request never queued")
        cluster.call(reg.stop())  # the record leaves while it waits
        wait(lambda: cluster.on_loop(open_channels) == 0, 10, "the channel to the departed prefill worker stayed open")
        cluster.on_loop(admission.unhold)
        held = False
        caller.join(60)
        assert result == [want]
        assert fake.calls == 1, "the queued request dialled the departed prefill worker"
        assert cluster.on_loop(open_channels) == 0, "a channel to the departed prefill worker was opened again"
    finally:
        if held:
            cluster.on_loop(admission.unhold)
        cluster.call(server.stop(0))
        cluster.stop(decode)


class FakeDecode(SessionMixin, decode_pb2_grpc.DecodeServiceServicer):
    """Streams `tokens` from 1000 + sampling_step_offset on; after `hang_after` of them, goes silent."""

    def __init__(self, hang_after: int | None = None) -> None:
        self.hang_after = hang_after
        self.requests: list[decode_pb2.DecodeRequest] = []
        self.time_remaining: list[float | None] = []
        self.cancelled = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        try:
            for k in range(request.sampling.max_tokens):
                if self.hang_after is not None and k == self.hang_after:
                    await asyncio.sleep(3600)
                last = k == request.sampling.max_tokens - 1
                yield decode_pb2.DecodeResponse(token_ids=[1000 + request.sampling_step_offset + k], logprobs=[0.0],
                                                finish_reason=sampling_pb2.FINISH_REASON_LENGTH if last else 0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def fake_server(servicer: FakeDecode):
    return await start_server("127.0.0.1:0", [lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(
        servicer, s)], ["tandem.v1.DecodeService"])


def test_silent_stream_moves_after_the_stall_timeout_and_calls_carry_the_default_deadline(cluster):
    stall_s, default_s = 0.5, 100.0
    router = cluster.start("router", health_interval_s=HEALTH_S, health_timeout_s=HEALTH_S,
                           token_stall_timeout_s=stall_s, default_deadline_s=default_s)
    hang, good = FakeDecode(hang_after=3), FakeDecode()
    servers = [cluster.call(fake_server(f)) for f in (hang, good)]
    regs = [record(cluster, "decode-hangs", f"127.0.0.1:{servers[0].port}"),
            record(cluster, "decode-good", f"127.0.0.1:{servers[1].port}")]
    try:
        cluster.call(regs[0].start())
        cluster.wait_roles(router, 0, 1)
        cluster.call(regs[1].start())
        cluster.wait_roles(router, 0, 2)
        with grpc.insecure_channel(router.address) as ch:
            stub = frontend_pb2_grpc.FrontendServiceStub(ch)
            # Pin the first call to the silent worker: the other is set aside until that call is open.
            cluster.on_loop(router.workers.set_aside, "decode-good", 60.0)

            def back_in_rotation() -> None:
                wait(lambda: hang.requests, 30, "the call never reached the silent worker")
                cluster.on_loop(router.workers.set_aside, "decode-good", 0.0)

            helper = threading.Thread(target=back_in_rotation, daemon=True)
            helper.start()
            start = time.monotonic()
            got = [t for m in stub.Generate(frontend_pb2.GenerateRequest(
                token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=8))) for t in m.token_ids]
            took = time.monotonic() - start
            helper.join(30)
        assert got == [1000 + k for k in range(8)]  # 3 from the silent worker, 5 from the other: no gap, no repeat
        assert stall_s <= took < stall_s + 10
        moved = good.requests[-1]
        assert list(moved.token_ids) == [5, 6, 7, 1000, 1001, 1002] and moved.sampling_step_offset == 3
        assert moved.sampling.max_tokens == 5
        # The client set no deadline: the router's calls carry --default-deadline from arrival (the
        # wire format rounds a timeout up, hence + 2).
        assert hang.time_remaining[0] is not None and default_s - 30 < hang.time_remaining[0] <= default_s + 2
        assert good.time_remaining[-1] is not None and good.time_remaining[-1] <= hang.time_remaining[0] + 1
        wait(lambda: hang.cancelled == 1, 10, "the silent worker's call was not cancelled")
        assert router.servicer.migrations == 1
    finally:
        for r in regs:
            cluster.call(r.stop())
        for s in servers:
            cluster.call(s.stop(0))
        cluster.stop(router)


def test_request_beyond_every_pool_is_refused_at_once_while_others_flow(cluster, tiny_model):
    router = cluster.start("router")
    small = cluster.start("decode", num_blocks=32)  # 32 blocks of 16 tokens: 512 tokens of KV
    try:
        cluster.wait_roles(router, 0, 1)
        with grpc.insecure_channel(router.address) as ch:
            stub = frontend_pb2_grpc.FrontendServiceStub(ch)
            prompts = [[3 + i, 4, 5, 6] for i in range(3)]
            calls = [stub.Generate(frontend_pb2.GenerateRequest(token_ids=p, sampling=sampling_pb2.SamplingParams(
                max_tokens=24, ignore_eos=True)), timeout=60) for p in prompts]
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(frontend_pb2.GenerateRequest(token_ids=[9] * 20, sampling=sampling_pb2.SamplingParams(
                    max_tokens=1000, ignore_eos=True)), timeout=60))
            refused_in = time.monotonic() - start
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "prompt (20 tokens) + max_tokens (1000) needs 64 KV blocks" in e.value.details()
            assert "whole pool has 32 blocks" in e.value.details()
            assert refused_in < 5, f"refused after {refused_in:.1f} s"
            outs = [[t for m in c for t in m.token_ids] for c in calls]
        for p, got in zip(prompts, outs):
            assert got == reference_generate(tiny_model.model, p, 24)
        rt = small.runtime
        wait(lambda: cluster.on_loop(lambda: rt.pool.blocks.num_free) == rt.pool.blocks.num_blocks, 10,
             "blocks left behind")
    finally:
        cluster.stop(small)
        cluster.stop(router)


def test_a_worker_stopped_while_it_registers_returns_and_leaves_nothing(tiny_model):
    """SIGTERM's handler only sets the stop event; a worker whose etcd does not answer yet (a
    listener that never speaks) stops at it, without an error, instead of waiting out its
    registration attempt."""
    from worker.host import WorkerOptions, WorkerRuntime, serve_worker

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: each etcd call times out
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.extend(iter(lambda: silent.accept()[0], None)), daemon=True).start()

    async def main() -> float:
        rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, WorkerOptions(
            model=tiny_model.name, num_blocks=8, etcd=f"127.0.0.1:{silent.getsockname()[1]}", port=0), tiny_model)
        stop = asyncio.Event()
        ports: list[int] = []
        task = asyncio.create_task(serve_worker(rt, [], [], ready=lambda s: ports.append(s.port), stop=stop))
        await asyncio.sleep(1.0)  # the server is up, the registration waits for etcd
        assert not task.done() and not ports  # not ready: not registered
        t0 = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 10)  # returns: no error
        return time.monotonic() - t0

    try:
        took = asyncio.run(main())
    finally:
        silent.close()
    assert took < 3, f"stopping took {took:.1f} s (the registration's etcd timeout is 5 s per attempt)"


def test_the_front_is_ready_only_while_a_decode_worker_serves(cluster):
    """The router's tandem.v1.FrontendService health status (a readiness probe's) follows its
    decode workers, while the whole server's ("", a liveness probe's) stays SERVING; `tandem
    health` without --service exits 0 and says the front cannot serve."""
    import subprocess
    import sys
    from pathlib import Path

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    router = cluster.start("router", health_interval_s=HEALTH_S, health_timeout_s=HEALTH_S)
    decode = None

    def status(service: str) -> str:
        with grpc.insecure_channel(router.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def health_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", "health", router.address, *args],
                              cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"})
    front = "tandem.v1.FrontendService"
    try:
        wait(lambda: status(front) == "NOT_SERVING", 10, "a router without decode workers says its front serves")
        assert status("") == "SERVING"
        alive = health_cli()
        assert alive.returncode == 0 and f"{front} is NOT_SERVING: no healthy decode worker" in alive.stdout, \
            alive.stdout + alive.stderr
        assert health_cli("--service", front).returncode == 1
        decode = cluster.start("decode")
        wait(lambda: status(front) == "SERVING", 15, "the front stays NOT_SERVING with a decode worker up")
        ready = health_cli("--service", front)
        assert ready.returncode == 0 and "SERVING" in ready.stdout, ready.stdout + ready.stderr
        assert "NOT_SERVING" not in health_cli().stdout
        cluster.stop(decode)
        decode = None
        wait(lambda: status(front) == "NOT_SERVING", 15, "the front still SERVING after its decode worker left")
        assert status("") == "SERVING"
    finally:
        if decode is not None:
            cluster.stop(decode)
        cluster.stop(router)
