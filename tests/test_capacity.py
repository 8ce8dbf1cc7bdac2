"""Capacity planning (docs/bench/capacity.md): the seed's table, pool sizing from
--mem-fraction-static, admission control, and the retraction order (unit tests, no servers)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import pytest

from cli.plan import PlanOptions, build_plans, context_note, register, render, table
from decode_worker.admission import Admission, Refused
from decode_worker.retraction import retraction_order
from engine.capacity import (DEEPSEEK_R1, GIB, PlanInputs, module_bytes, parse_bytes, parse_tokens, plan,
                             pool_blocks_from_memory)
from engine.kv_pool import KvPool, KvPoolConfig
from worker.host import DEFAULT_NUM_BLOCKS, WorkerOptions, pool_blocks


def plan_main(*argv: str) -> int:
    import argparse
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_seed_table_comes_out_exactly():
    """288 vs 192 GB HBM at 0.75, 40 GB weights, 136K tokens of 35,136 B (docs/bench/capacity.md)."""
    assert DEEPSEEK_R1.bytes_per_token == 35_136
    label, fp, (b300, b200) = build_plans(PlanOptions())  # the defaults are the seed's inputs
    assert label == "deepseek-r1" and fp.bytes_per_token == 35_136
    assert b300.pool_bytes == 176 * GIB and b200.pool_bytes == 104 * GIB
    assert b300.inputs.cached_tokens == 136_000
    assert b300.per_request_bytes == 136_000 * 35_136 and round(b300.per_request_bytes / GIB, 2) == 4.45
    # theoretical caps: the seed's "≈ 40" and "≈ 24"
    assert b300.theoretical_per_gpu == pytest.approx(39.55, abs=0.01) and round(b300.theoretical_per_gpu) == 40
    assert b200.theoretical_per_gpu == pytest.approx(23.37, abs=0.01) and abs(b200.theoretical_per_gpu - 24) < 1
    # practical: 36 and 20 per GPU at 90 % and 85 %, 576 and 320 over EP16
    assert (b300.inputs.practical_fraction, b200.inputs.practical_fraction) == (0.90, 0.85)
    assert (b300.practical_per_gpu, b200.practical_per_gpu) == (36, 20)
    assert (b300.practical_total, b200.practical_total) == (576, 320)
    text = render(table(label, fp, [b300, b200]), "seed", "text")
    for cell in ("176 GiB", "104 GiB", "35,136 B", "4.45 GiB", "39.55", "23.37", "576", "320"):
        assert cell in text


def test_tandem_plan_prints_the_seed_table(capsys, monkeypatch):
    for var in ("TANDEM_MODEL", "TANDEM_HBM", "TANDEM_EP_SIZE", "TANDEM_MEM_FRACTION_STATIC"):
        monkeypatch.delenv(var, raising=False)
    assert plan_main("--format", "markdown") == 0
    out = capsys.readouterr().out
    assert "| KV pool per GPU | 176 GiB | 104 GiB |" in out
    assert "| practical over EP16 | 576 | 320 |" in out


def test_plan_flags_and_units():
    assert parse_bytes("288GiB") == 288 * GIB and parse_bytes("141GB") == 141 * 10**9 and parse_bytes("2") == 2 * GIB
    assert parse_tokens("136K") == 136_000 and parse_tokens("128Ki") == 131_072 and parse_tokens("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")
    _, fp, plans = build_plans(PlanOptions(hbm="141GB", kv_dtype="bf16", practical_fractions="0.9", ep_size=8,
                                           input_len="32K", output_len="1K"))
    assert fp.bytes_per_token == 2 * 35_136 and len(plans) == 1 and plans[0].practical_total == 8 * plans[0].practical_per_gpu
    with pytest.raises(ValueError, match="--practical-fractions"):
        build_plans(PlanOptions(hbm="80GiB,141GB,192GiB", practical_fractions="0.9,0.8"))  # two for three
    # the default pair (the seed's two columns) gives its first value to a plan of other columns
    assert [p.inputs.practical_fraction for p in build_plans(PlanOptions(hbm="141GB"))[2]] == [0.9]
    with pytest.raises(ValueError, match="--kv-dtype"):
        PlanOptions(kv_dtype="int3")
    with pytest.raises(ValueError, match="--hbm"):
        PlanOptions(hbm="lots")
    with pytest.raises(ValueError, match="mem_fraction_static"):
        PlanInputs(GIB, 1.5, 0, 1, 1)


def test_plan_from_a_model_config_estimates_weights_per_gpu():
    opts = PlanOptions(model="tandem-tiny", hbm="1GiB", practical_fractions="0.9", kv_dtype="fp32", ep_size=1)
    _, fp, (p1,) = build_plans(opts)
    _, _, (p2,) = build_plans(replace(opts, ep_size=2))
    assert fp.bytes_per_token == (32 + 8) * 5 * 4  # tiny: (kv_lora_rank + rope) × (4 layers + MTP) × fp32
    assert 0 < p2.inputs.weight_bytes < p1.inputs.weight_bytes  # routed experts split over EP


def test_plan_notes_requests_longer_than_the_models_context():
    opts = PlanOptions(model="tandem-shakespeare", hbm="141GB", practical_fractions="0.9")
    note = context_note(opts)  # the defaults, 128K + 8K tokens, against a 2,048-token model
    assert note is not None and "136,000 tokens" in note and "2,048" in note
    assert context_note(replace(opts, input_len="1K", output_len="1048")) is None  # exactly the context
    assert context_note(replace(opts, input_len="2048", output_len="0")) is not None  # no room for a token
    assert context_note(PlanOptions()) is None  # a preset has no context of its own


def test_plan_counts_an_mtp_modules_layers_aloud_and_a_datasheets_gb(capsys):
    """tandem-shakespeare has 6 layers and an MTP layer, whose KV the pool holds too: the title
    says 7 KV layers as 6 + 1 MTP, not 7 layers; --hbm 141GB heads its column as 131 GiB (141 GB)."""
    from cli.plan import main
    assert main(PlanOptions(model="tandem-shakespeare", hbm="141GB", practical_fractions="0.9",
                            input_len="1K", output_len="1K")) == 0
    out = capsys.readouterr().out
    assert "× 7 KV layers (6 + 1 MTP) ×" in out and "131 GiB (141 GB)" in out, out
    assert main(PlanOptions()) == 0
    out = capsys.readouterr().out
    assert "× 61 layers ×" in out and "288 GiB GPU" in out and "GB)" not in out, out


def test_theoretical_cap_is_pool_over_per_request():
    p = plan(PlanInputs(hbm_bytes=100, mem_fraction_static=0.5, weight_bytes=10, cached_tokens=4, bytes_per_token=2,
                        ep_size=3, practical_fraction=0.5))
    assert (p.pool_bytes, p.per_request_bytes, p.theoretical_per_gpu, p.practical_per_gpu, p.practical_total) == \
        (40, 8, 5.0, 3, 9)  # round(2.5) = 3 (half up), capped at floor(5.0)


def test_pool_blocks_from_mem_fraction(tiny_model):
    cfg = KvPoolConfig(num_blocks=1, block_size=16, num_layers=4, kv_dim=40)
    weights = module_bytes(tiny_model.model)
    memory = int((weights + 37.5 * cfg.block_bytes) / 0.5)
    opts = WorkerOptions(mem_fraction_static=0.5, device_memory_bytes=memory)
    assert pool_blocks(opts, tiny_model, cfg) == 37 == pool_blocks_from_memory(memory, 0.5, weights, cfg.block_bytes)
    assert pool_blocks(WorkerOptions(mem_fraction_static=0.5, device_memory_bytes=memory, num_blocks=9),
                       tiny_model, cfg) == 9  # --num-blocks wins
    assert pool_blocks(WorkerOptions(), tiny_model, cfg) == DEFAULT_NUM_BLOCKS
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        pool_blocks(WorkerOptions(mem_fraction_static=0.5, device_memory_bytes=weights), tiny_model, cfg)
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        WorkerOptions(mem_fraction_static=1.5)


def pool(n: int = 10, bs: int = 4) -> KvPool:
    return KvPool(KvPoolConfig(num_blocks=n, block_size=bs, num_layers=1, kv_dim=2), 1)


def test_admission_queues_fifo_and_releases():
    async def main():
        adm = Admission(pool(10), practical_fraction=0.8, max_queued=2)  # budget 8 blocks
        a = await adm.admit(prompt_tokens=10, max_tokens=10)  # 5 blocks
        b_task = asyncio.create_task(adm.admit(10, 10))
        c_task = asyncio.create_task(adm.admit(2, 2))  # 1 block: fits, but waits behind b (FIFO)
        await asyncio.sleep(0)
        assert adm.queued == 2 and adm.reserved == 5 and adm.waited == 2
        with pytest.raises(Refused, match="queue full"):
            await adm.admit(1, 1)
        adm.release(a)
        adm.release(a)  # idempotent
        b, c = await b_task, await c_task
        assert adm.reserved == 6 and adm.admitted == 2 and adm.queued == 0
        adm.release(b)
        adm.release(c)
        assert adm.reserved == 0 and adm.admitted == 0

    asyncio.run(main())


def test_admission_lone_request_and_refusals():
    async def main():
        adm = Admission(pool(10), practical_fraction=0.5, max_queued=4)
        with pytest.raises(Refused, match=r"prompt \(8 tokens\) \+ max_tokens \(1000\) needs 252 KV blocks.*has 10"):
            await adm.admit(prompt_tokens=8, max_tokens=1000)  # can never fit the pool: refused at once
        big = await adm.admit(prompt_tokens=8, max_tokens=24)  # 8 blocks, over the budget of 5, but alone: admitted
        assert big.blocks == 8
        with pytest.raises(Refused, match="whole pool has 10 blocks"):
            await adm.admit(prompt_tokens=40, max_tokens=1)  # the prompt can never fit
        waiter = asyncio.create_task(adm.admit(1, 1))
        await asyncio.sleep(0)
        waiter.cancel()  # the caller went away while queued: nothing held
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.queued == 0 and adm.admitted == 1
        adm.hold()  # a retracted request waits: new ones queue behind it even with room
        adm.release(big)
        held = asyncio.create_task(adm.admit(1, 1))
        await asyncio.sleep(0)
        assert adm.queued == 1
        adm.unhold()
        adm.release(await held)
        assert adm.reserved == 0 and adm.admitted == 0

    asyncio.run(main())


def test_admission_a_request_that_fits_only_alone_holds_no_one_back_and_waits_a_bounded_time():
    async def main():
        adm = Admission(pool(10), practical_fraction=0.5, max_queued=4, solo_wait_s=0.2)  # budget 5 blocks
        a = await adm.admit(4, 4)  # 2 blocks
        solo = asyncio.create_task(adm.admit(8, 24))  # 8 blocks: only alone
        await asyncio.sleep(0)
        assert adm.queued == 1
        b = await asyncio.wait_for(adm.admit(4, 4), 1)  # fits: goes past the solo request at once
        start = time.monotonic()
        with pytest.raises(Refused, match=r"needs 8 KV blocks.*budget of 5.*within 0.2 s \(--solo-wait\)"):
            await solo
        assert 0.15 < time.monotonic() - start < 5
        assert adm.queued == 0 and adm.reserved == 4
        adm.release(a)
        solo = asyncio.create_task(adm.admit(8, 24))
        c = asyncio.create_task(adm.admit(4, 12))  # 4 blocks: waits for room, like before
        await asyncio.sleep(0)
        adm.release(b)  # nothing admitted: the solo request runs, and c (behind it) waits for it
        alone = await asyncio.wait_for(solo, 1)
        assert adm.admitted == 1 and adm.queued == 1
        adm.release(alone)
        adm.release(await asyncio.wait_for(c, 1))
        assert adm.reserved == 0 and adm.admitted == 0 and adm.queued == 0

    asyncio.run(main())


def test_admission_a_request_running_alone_yields_its_turn_to_waiting_requests():
    from decode_worker.admission import MIN_TURN_S

    async def main():
        adm = Admission(pool(10), practical_fraction=0.5, max_queued=4, solo_wait_s=0.2)  # budget 5 blocks
        alone = await adm.admit(8, 24)  # 8 blocks: runs alone
        assert adm.overdue_solo(time.monotonic() + 60) is None  # nobody waits behind it
        b = asyncio.create_task(adm.admit(4, 4))  # 2 blocks: waits for it
        await asyncio.sleep(0)
        assert adm.queued == 1
        t0 = alone.granted_at
        assert adm.overdue_solo(t0 + MIN_TURN_S / 2) is None  # its turn lasts at least MIN_TURN_S
        assert adm.overdue_solo(t0 + MIN_TURN_S) is alone
        turn = adm.yield_turn(alone)  # (the decode loop has retracted it)
        got_b = await asyncio.wait_for(b, 1)  # admitted at once
        late = asyncio.create_task(adm.admit(2, 2))  # arrives after: waits behind the yielded request
        await asyncio.sleep(0)
        assert not turn.done() and not late.done() and adm.queued == 2 and adm.reserved == 2
        assert adm.overdue_solo(time.monotonic() + 60) is None  # nothing runs alone now
        adm.release(got_b)
        assert await asyncio.wait_for(turn, 1) is alone  # its next turn, with the same ticket
        assert adm.admitted == 1 and adm.reserved == 8 and adm.queued == 1 and alone.granted_at > t0
        adm.release(alone)
        adm.release(await asyncio.wait_for(late, 1))
        assert adm.reserved == 0 and adm.admitted == 0
        # A request that goes away while it waits for its turn holds nothing.
        alone = await adm.admit(8, 24)
        c = asyncio.create_task(adm.admit(4, 4))
        await asyncio.sleep(0)
        turn = adm.yield_turn(alone)
        got_c = await asyncio.wait_for(c, 1)
        adm.cancel_turn(turn)
        adm.release(alone)  # a no-op: its reservation went with its turn
        adm.release(got_c)
        assert adm.reserved == 0 and adm.admitted == 0 and adm.queued == 0 and turn.cancelled()

    asyncio.run(main())


@dataclass
class R:
    name: str
    generated: int
    prompt_len: int


def test_retraction_order_fewest_generated_then_longest_prompt():
    reqs = [R("a", 5, 10), R("b", 2, 10), R("c", 2, 30), R("d", 9, 99)]
    assert [r.name for r in retraction_order(reqs)] == ["c", "b", "a", "d"]


class FakeScheduler:
    """Just what Retractor touches: running list, runtime (pool, stats), admission, release, _finish."""

    def __init__(self, kv: KvPool) -> None:
        from types import SimpleNamespace

        from worker.host import WorkerStats
        self.rt = SimpleNamespace(pool=kv, stats=WorkerStats())
        self.running: list = []
        self.admission = Admission(kv, practical_fraction=4.0, max_queued=4)
        self.finished: list = []
        self.release = kv.free  # the plain loop frees at once (the overlap loops defer it)

    def pending_free_blocks(self) -> int:
        return 0  # the plain loop: nothing deferred

    def _finish(self, req, out) -> None:
        self.running.remove(req)
        self.rt.pool.free(req.block_ids)
        self.finished.append((req, out))


def running_request(kv: KvPool, name: str, prompt_len: int, generated: int, max_tokens: int = 100):
    from common.sampling_params import SamplingParams
    from decode_worker.scheduler import RunningRequest
    tokens = list(range(1, prompt_len + generated + 1))
    blocks = kv.blocks.allocate(kv.blocks_for(len(tokens) - 1))  # KV of all but the last token
    return RunningRequest(name, tokens, prompt_len, blocks, SamplingParams(max_tokens=max_tokens))


def test_make_room_retracts_in_order_until_headroom_and_keeps_the_last_one():
    from decode_worker.retraction import HEADROOM_STEPS, Retractor
    kv = pool(n=12, bs=4)
    sched = FakeScheduler(kv)
    a = running_request(kv, "a", prompt_len=8, generated=5)  # 12 tokens of KV in 3 blocks: needs a 4th
    b = running_request(kv, "b", prompt_len=4, generated=9)  # the same
    c = running_request(kv, "c", prompt_len=12, generated=3)  # 14 tokens in 4 blocks: room for its next
    d = running_request(kv, "d", prompt_len=4, generated=3)  # 6 tokens in 2 blocks: room for its next
    sched.running = [a, b, c, d]
    r = Retractor(sched)
    assert r._need(sched.running, 1) == 2 and kv.blocks.num_free == 0
    batch = r.make_room(list(sched.running))
    # c and d have generated fewest (3); c's longer prompt makes it first. After both, a and b have
    # the 4 new blocks their next HEADROOM_STEPS steps need in the 6 freed.
    assert [req.request_id for req in r.waiting] == ["c", "d"]
    assert batch == sched.running == [a, b] and kv.blocks.num_free == 6
    assert r._need(batch, HEADROOM_STEPS) <= kv.blocks.num_free
    assert sched.rt.stats.retractions == 2 and sched.admission.held == 2
    assert all(req.block_ids == [] for req in r.waiting)
    # The last running request is not retracted while its own step fits, headroom or not.
    kv2 = pool(n=4, bs=4)
    sched2 = FakeScheduler(kv2)
    x = running_request(kv2, "x", prompt_len=4, generated=9)  # 12 tokens of KV in 3 blocks: needs a 4th
    y = running_request(kv2, "y", prompt_len=4, generated=1)  # 4 tokens in 1 block: needs a 2nd
    sched2.running = [x, y]
    r2 = Retractor(sched2)
    assert r2.make_room([x, y]) == [x] and [q.request_id for q in r2.waiting] == ["y"]
    assert r2._need([x], HEADROOM_STEPS) > kv2.blocks.num_free >= r2._need([x], 1)


def test_make_room_ends_a_request_larger_than_the_pool():
    from decode_worker.retraction import Retractor
    kv = pool(n=2, bs=4)
    sched = FakeScheduler(kv)
    big = running_request(kv, "big", prompt_len=4, generated=5)  # 9 tokens need 3 blocks > 2
    sched.running = [big]
    assert Retractor(sched).make_room([big]) == []
    (req, out), = sched.finished
    assert req is big and out.error[0].name == "RESOURCE_EXHAUSTED" and kv.blocks.num_free == 2


def test_plan_refuses_memory_that_leaves_no_pool():
    with pytest.raises(ValueError, match="--hbm .* leaves no KV pool"):
        build_plans(PlanOptions(hbm="32GiB", practical_fractions="0.9"))  # 0.75 × 32 GiB < 40 GiB of weights


def decode_scheduler(loaded, **options):
    """A real DecodeScheduler on the tiny model (its loop not started: tests drive it by hand)."""
    from common.pb.tandem.v1 import discovery_pb2
    from decode_worker.scheduler import DecodeScheduler
    from worker.host import WorkerRuntime
    rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, WorkerOptions(model=loaded.name, **options), loaded)
    sched = DecodeScheduler(rt)
    sched.admission.solo_wait_s = rt.opts.solo_wait_s  # as DecodeServicer does
    return rt, sched


def test_a_lone_requests_turn_counts_from_its_first_decode_step_not_its_prefill(tiny_model):
    """A request that fits only alone is granted its turn before its prefill (remote, or the
    re-prefill after a yield, which for a long prompt can take longer than --solo-wait). Were the
    turn counted from the grant, it would be retracted as soon as it joined the batch, without a
    single decode step, at every turn while small requests keep arriving: it would never finish."""
    from common.sampling_params import SamplingParams
    from decode_worker.admission import MIN_TURN_S
    from decode_worker.scheduler import RunningRequest

    async def main():
        rt, sched = decode_scheduler(tiny_model, num_blocks=16, practical_fraction=0.5, solo_wait_s=0.2)
        adm = sched.admission
        try:
            prompt = [(7 * j) % 9000 + 1 for j in range(64)]
            ticket = await adm.admit(len(prompt), 128)  # 12 blocks of 16 tokens, over the budget of 8: alone
            small = asyncio.create_task(adm.admit(4, 4))
            await asyncio.sleep(0)
            assert adm.queued == 1
            # Its prefill took 10 s, and the small request waited behind it all along.
            ticket.granted_at -= 10
            adm._queue[0].since -= 10
            blocks = rt.pool.allocate_prompt(prompt)
            req = RunningRequest("alone", prompt + [5], len(prompt), blocks.block_ids,
                                 SamplingParams(max_tokens=128), ticket=ticket)
            sched.add(req)  # it starts decoding now
            sched.retraction.yield_solo()
            assert req in sched.running and rt.stats.solo_yields == 0, "retracted before its first decode step"
            ticket.granted_at -= max(adm.solo_wait_s, MIN_TURN_S)  # it has decoded for a whole turn
            sched.retraction.yield_solo()
            assert req not in sched.running and rt.stats.solo_yields == 1
            adm.release(await asyncio.wait_for(small, 1))
            adm.cancel_turn(sched.retraction.yielded.pop(req))
            assert adm.reserved == 0 and adm.admitted == 0 and adm.queued == 0
        finally:
            rt.close()

    asyncio.run(main())


def test_retracted_request_resumes_when_fenced_blocks_come_back(tiny_model):
    """A retracted request (or a lone one back for its turn) whose re-prefill finds the pool
    short only because of blocks fenced after an unanswered prefill call (decode_worker/fence.py)
    resumes once the fence releases them: the idle decode loop is woken. Otherwise it waited for
    an unrelated wake-up while admission held every new request behind it."""
    from common.sampling_params import SamplingParams
    from decode_worker.scheduler import RunningRequest
    from decode_worker.service import DecodeServicer
    from worker.peers import PeerDirectory

    async def main():
        rt, sched = decode_scheduler(tiny_model, num_blocks=8)
        servicer = DecodeServicer(rt, sched, PeerDirectory(tiny_model.name, tiny_model.fingerprint))
        adm = sched.admission
        loop = asyncio.create_task(sched.run())
        try:
            prompt = [(13 * j) % 9000 + 1 for j in range(40)]
            req = RunningRequest("retracted", prompt + [7, 9], len(prompt), [], SamplingParams(max_tokens=4),
                                 ticket=await adm.admit(len(prompt), 4))
            fenced = rt.pool.blocks.allocate(7)  # a fence holds them: the re-prefill's 3 blocks are not there
            sched.retraction.waiting.append(req)  # as Retractor.retract leaves it
            adm.hold()
            sched._wake.set()
            for _ in range(10):  # the loop tries, finds the pool short, and idles
                await asyncio.sleep(0)
            assert sched.retraction.waiting and not sched.running
            servicer._free_fenced(fenced)  # the prefill worker answered Abandon
            out = await asyncio.wait_for(req.out.get(), 10)
            assert out.token is not None
            while not (await asyncio.wait_for(req.out.get(), 10)).finish_reason:
                pass
            assert adm.held == 0 and adm.admitted == 0 and rt.pool.blocks.num_free == 8
        finally:
            loop.cancel()
            await servicer.close()
            rt.close()

    asyncio.run(main())
