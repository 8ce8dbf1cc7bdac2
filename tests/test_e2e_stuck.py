"""A decode worker that stops answering without closing its connections (SIGSTOP): the router
takes its open calls away once health probes find it unhealthy and every request completes on
the other decode worker with exactly the fault-free tokens — mid-stream and before the first
token, with and without a client deadline, greedy and seeded. After SIGCONT the stopped worker
holds no blocks and no requests (issue 20)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request

import pytest

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, sampling_pb2
from common.sampling_params import SamplingParams
from engine.model_source import TINY
from engine.reference import reference_generate
from engine.sampling import sample

pytestmark = pytest.mark.e2e
INTERVAL, TIMEOUT, THRESHOLD = 0.3, 0.3, 2  # router health settings: unhealthy ~0.9 s after the stop
# Detection (threshold × interval + the probe timeout) plus one re-prefill of a short prompt,
# tripled with 5 s to spare for a loaded 2-core machine; without failover the wait is unbounded.
BOUND_S = 3 * (THRESHOLD * INTERVAL + TIMEOUT) + 5.0
MAX_TOKENS = 32


def sampling(i: int) -> sampling_pb2.SamplingParams:
    if i % 2:
        return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, seed=500 + i)
    return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def reference(model, prompt: list[int], s: sampling_pb2.SamplingParams) -> list[int]:
    if not s.HasField("temperature"):
        return reference_generate(model, prompt, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=s.temperature, seed=s.seed, ignore_eos=True)
    return reference_generate(model, prompt, MAX_TOKENS, sample_fn=lambda row, step: sample(row, params, step)[0])


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


def test_sigstopped_decode_worker_every_request_moves_with_exact_tokens(tiny_model, tmp_path):
    prompts = [[(37 * i + 11 * j) % 150000 + 1 for j in range(12 + i)] for i in range(12)]

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-stuck", num_decode=2, log_dir=str(tmp_path), metrics=True,
                               router_args=["--health-interval", str(INTERVAL), "--health-timeout", str(TIMEOUT),
                                            "--health-failure-threshold", str(THRESHOLD)])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            ids = {n: next(i for i, inst in cluster.instances.items() if inst.role == discovery_pb2.ROLE_DECODE
                           and i in (tmp_path / f"{n}.log").read_text()) for n in ("decode-0", "decode-1")}
            metrics = cluster.metrics_addresses()
            router_metrics = next(a for i, a in metrics.items()
                                  if cluster.instances[i].role == discovery_pb2.ROLE_ROUTER)

            async def one(i: int, stamps: list[float], started: asyncio.Event | None = None,
                          everyone: list[list[float]] | None = None):
                out: list[int] = []
                # Even streams set no deadline: the router's --default-deadline bounds its own calls.
                kw = {"timeout": 120} if i % 3 == 0 else {}
                async for msg in stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompts[i],
                                                                            sampling=sampling(i)), **kw):
                    out += msg.token_ids
                    stamps.append(time.monotonic())
                    if started is not None and all(len(s) >= 3 for s in everyone):
                        started.set()
                return out

            async def healthy_decodes() -> int:
                resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
                return sum(c.role == "decode" for c in resp.candidates)

            # Mid-stream: 6 streams on both workers, each past its third token; stop decode-0.
            stamps: list[list[float]] = [[] for _ in range(6)]
            started = asyncio.Event()
            tasks = [asyncio.create_task(one(i, stamps[i], started, stamps)) for i in range(6)]
            await asyncio.wait_for(started.wait(), 60)
            pid = cluster.procs["decode-0"].pid
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                mid = await asyncio.wait_for(asyncio.gather(*tasks), 90)
            finally:
                os.kill(pid, signal.SIGCONT)
            gaps = [max((b - a for a, b in zip(s, s[1:]) if b > stopped_at), default=0.0) for s in stamps]
            migrated = scrape(router_metrics)["tandem_router_migrations_total"]

            # Before the first token: decode-0 is back; stop decode-1 and send 6 new requests at once.
            deadline = time.monotonic() + 30
            while await healthy_decodes() < 2:
                assert time.monotonic() < deadline, "decode-0 did not come back after SIGCONT"
                await asyncio.sleep(0.1)
            pid = cluster.procs["decode-1"].pid
            os.kill(pid, signal.SIGSTOP)
            sent = time.monotonic()
            first = [[] for _ in range(6, 12)]
            try:
                before = await asyncio.wait_for(asyncio.gather(*(one(i, first[i - 6]) for i in range(6, 12))), 90)
            finally:
                os.kill(pid, signal.SIGCONT)
            ttft = [s[0] - sent for s in first]
            retried = scrape(router_metrics)["tandem_router_retries_total"]

            # After SIGCONT: the stopped workers hold nothing (their calls were cancelled).
            deadline = time.monotonic() + 30
            while True:
                held = {n: scrape(metrics[ids[n]]) for n in ids}
                left = {n: (m["tandem_worker_kv_used_blocks"], m["tandem_worker_requests_in_flight"])
                        for n, m in held.items()}
                if all(v == (0, 0) for v in left.values()):
                    break
                assert time.monotonic() < deadline, f"blocks or requests left behind: {left}"
                await asyncio.sleep(0.2)
            await ch.close()
            return mid + before, gaps, ttft, migrated, retried

    results, gaps, ttft, migrated, retried = asyncio.run(main())
    for i, got in enumerate(results):
        assert got == reference(tiny_model.model, prompts[i], sampling(i)), f"stream {i} differs"
    assert migrated >= 1 and retried >= 1, (migrated, retried)
    assert max(gaps) < BOUND_S, f"a migrated stream paused {max(gaps):.1f} s (bound {BOUND_S:.1f} s)"
    assert max(ttft) < BOUND_S + 2, f"a request waited {max(ttft):.1f} s for its first token"


PREFILL_TIMEOUT = 1.5  # the decode → prefill call's deadline: the local fallback starts then
# Each KV write's limit; generous because the fence's bound, 2 × (prefill + transfer timeout),
# must outlast the stop: the fence is to be released by the resumed worker's Abandon answer.
TRANSFER_TIMEOUT = 10.0


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


async def until(check, what: str, timeout_s: float = 30.0):
    """Poll `check()` (a value, falsy until done) every 0.1 s; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} (after {timeout_s:.0f} s)"
        await asyncio.sleep(0.1)
    return value


def fence_over(m: dict[str, float]) -> dict[str, float] | None:
    """The decode worker's metrics once its fenced prefill was released (by answer or bound)."""
    done = sum(m[f"tandem_worker_fences_{k}_total"] for k in ("released_by_peer", "released_peer_gone", "expired"))
    return m if m["tandem_worker_fenced_prefills_total"] and done else None


async def prefill_in_rotation(stub, want: bool, timeout_s: float = 30.0) -> None:
    """Wait until the router does (want) or does not route to a prefill worker."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1] * 64), timeout=5)
        if any(c.role == "prefill" for c in resp.candidates) == want:
            return
        assert time.monotonic() < deadline, f"prefill worker {'never back' if want else 'still'} in rotation"
        await asyncio.sleep(0.1)


def test_prefill_worker_stopped_mid_transfer_local_fallback_fence_no_leak(tiny_model, tmp_path, monkeypatch):
    """The prefill worker stops itself (SIGSTOP) after its first chunk's KV write went out and its
    second was posted (test hook TANDEM_TEST_STOP_AFTER_WRITES). The decode worker's call ends at
    --prefill-timeout, it prefills locally into fresh blocks and fences the ones it gave away; the
    request completes with the reference tokens. A second request runs while the prefill worker
    resumes (SIGCONT): its tokens are exact too (no stale write reached its blocks); the resumed
    worker posts nothing more, answers Abandon, and both pools return to their start."""
    a = [(41 * j + 7) % 150000 + 1 for j in range(600)]  # 3 chunks of --chunk-size 256: 3 writes
    b = [(53 * j + 5) % 150000 + 1 for j in range(1100)]  # 69 of the 128 blocks
    c = [(61 * j + 3) % 150000 + 1 for j in range(300)]
    monkeypatch.setenv("TANDEM_TEST_STOP_AFTER_WRITES", "2")  # only prefill workers post KV writes

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-stuck-prefill", log_dir=str(tmp_path), metrics=True,
                               worker_args=["--num-blocks", "128", "--prefill-timeout", str(PREFILL_TIMEOUT),
                                            "--transfer-timeout", str(TRANSFER_TIMEOUT)],
                               router_args=["--health-interval", str(INTERVAL), "--health-timeout", str(TIMEOUT),
                                            "--health-failure-threshold", str(THRESHOLD)])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            metrics = cluster.metrics_addresses()
            ids = {n: next(i for i, inst in cluster.instances.items() if inst.role != discovery_pb2.ROLE_ROUTER
                           and i in (tmp_path / f"{n}.log").read_text()) for n in ("prefill-0", "decode-0")}
            decode, prefill = (lambda: scrape(metrics[ids["decode-0"]])), (lambda: scrape(metrics[ids["prefill-0"]]))
            start = {n: scrape(metrics[ids[n]])["tandem_worker_kv_used_blocks"] for n in ids}
            pid = cluster.procs["prefill-0"].pid

            async def generate(prompt, max_tokens, first: asyncio.Event | None = None):
                out: list[int] = []
                async for msg in stub.Generate(frontend_pb2.GenerateRequest(
                        token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens,
                                                                               ignore_eos=True)), timeout=120):
                    out += msg.token_ids
                    if first is not None:
                        first.set()
                return out

            t0 = time.monotonic()
            got_a = await generate(a, 4)
            took_a = time.monotonic() - t0
            assert stopped(pid), "the test hook did not stop the prefill worker mid-transfer"
            # a's own blocks return once its handler has finished (just after its last message):
            # then only the fenced ones are held. Without the fence this never happens (0 held).
            during = await until(lambda: (m := decode())["tandem_worker_kv_used_blocks"] == 38 and m,
                                 "the decode worker does not hold a's 38 fenced blocks", 10.0)
            await prefill_in_rotation(stub, False)  # the router's probes caught it: b is prefilled locally
            first = asyncio.Event()
            task_b = asyncio.create_task(generate(b, 48, first))
            await asyncio.wait_for(first.wait(), 60)
            os.kill(pid, signal.SIGCONT)  # resumed while b decodes in the decode worker's pool
            got_b = await task_b
            released = await until(lambda: fence_over(decode()), "the fence was never released")
            await prefill_in_rotation(stub, True)  # back after SIGCONT: a request through it again
            got_c = await generate(c, 4)
            end = {}
            for n in ids:  # every block back: the pools' used counts as at the start
                end[n] = await until(lambda n=n: start[n] == scrape(metrics[ids[n]])["tandem_worker_kv_used_blocks"],
                                     f"{n}: blocks still held after the requests ended")
            await ch.close()
            return got_a, took_a, during, got_b, released, got_c, start, end, prefill()

    got_a, took_a, during, got_b, released, got_c, start, end, prefill_m = asyncio.run(main())
    model = tiny_model.model
    assert got_a == reference_generate(model, a, 4)
    assert got_b == reference_generate(model, b, 48)
    assert got_c == reference_generate(model, c, 4)
    # Local fallback within the decode → prefill call's deadline (+ a local prefill, loaded machine).
    assert took_a < PREFILL_TIMEOUT + 8.0, f"request a took {took_a:.1f} s"
    # While stopped: a's 38 destination blocks fenced (held, though a itself is over).
    assert during["tandem_worker_fenced_prefills_total"] == 1
    # Released on the resumed worker's Abandon answer, not at the bound; its pending write refused.
    assert released["tandem_worker_fences_released_by_peer_total"] == 1, released
    assert released["tandem_worker_fences_expired_total"] == 0
    assert prefill_m["tandem_worker_kv_late_writes_refused_total"] >= 1
    assert start == {"prefill-0": 0, "decode-0": 0} and all(end.values())
