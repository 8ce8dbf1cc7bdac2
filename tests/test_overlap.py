"""The overlap scheduler's code path on a CPU (decode_worker/overlap.py): inputs resolved from
the future-token map, a finished request's extra in-flight token dropped, deferred block frees.
On a CPU each launch completes at once, but the placeholders, the map and the lagged
post-processing are the same code as on CUDA."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from common.sampling_params import SamplingParams
from decode_helpers import generate
from decode_worker.overlap import overlap_loop
from engine.future_map import FutureTokenMap
from engine.reference import reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_future_map_resolves_placeholders() -> None:
    fmap = FutureTokenMap(4, "cpu")
    slots = fmap.reserve(3)
    fmap.store(torch.tensor(slots), torch.tensor([7, 8, 9]))
    ids = torch.tensor([5, fmap.placeholder(slots[2]), fmap.placeholder(slots[0])])
    assert fmap.resolve(ids).tolist() == [5, 9, 7]
    assert fmap.reserve(2) == [3, 0]  # a ring


def test_cadence_counters_split_a_launch_span_over_its_steps(monkeypatch) -> None:
    """A launch of several steps: the time to the next launch is its steps' (each request of
    it waited that span / its steps a token), whatever rows its later steps kept."""
    from types import SimpleNamespace

    from decode_worker import scheduler as sched_mod
    from worker.host import WorkerStats
    launched = []
    fake = SimpleNamespace(rt=SimpleNamespace(stats=WorkerStats()), steps=0, _last_step=None, _last_rows=[],
                           pacer=SimpleNamespace(step_launched=lambda: launched.append(1)))
    clock = iter([10.0, 10.3, 10.4])
    monkeypatch.setattr(sched_mod.time, "perf_counter", lambda: next(clock))
    count = sched_mod.DecodeScheduler.count_launch
    count(fake, [4, 4, 2])  # the first launch after idling: no span yet
    count(fake, [3])  # 0.3 s later
    count(fake, [3])  # 0.1 s later
    st = fake.rt.stats
    assert (st.decode_steps, st.decode_step_rows, fake.steps, len(launched)) == (5, 16, 5, 5)
    assert st.decode_busy_steps == 4  # the three steps of the first launch and the one of the second
    assert st.decode_step_seconds == pytest.approx(0.4)
    # 10 rows waited 0.1 s a token (0.3 s over 3 steps), then 3 rows 0.1 s: 1.3 row-seconds
    assert st.decode_row_seconds == pytest.approx(0.3 * 10 / 3 + 0.1 * 3)
    # per busy row: the 0.1 s a token every row waited (the last launch's rows have no span yet)
    assert st.decode_busy_step_rows == 13 and st.decode_row_seconds / st.decode_busy_step_rows == pytest.approx(0.1)


def test_resolved_leaves_out_placeholders_in_flight() -> None:
    """The decode span's token count (tandem.decode.tokens) of a request cancelled mid-launch:
    the placeholders of its steps in flight never become tokens."""
    from decode_worker.scheduler import RunningRequest
    req = RunningRequest("r", [5, 6, 7, 11, 12, -3, -9], prompt_len=3, block_ids=[], params=SamplingParams())
    assert (req.generated, req.resolved) == (4, 2)
    req.tokens[5:] = [13, 14]
    assert req.resolved == req.generated == 4
    assert RunningRequest("p", [5, -1], prompt_len=2, block_ids=[], params=SamplingParams()).resolved == 0


@pytest.mark.parametrize("per_launch", [1, 2, 3, 4])
def test_overlap_greedy_equals_reference_and_frees_blocks(tiny_model, per_launch) -> None:
    """Also with several steps per launch (--decode-steps-per-launch): the eos in the first of
    a launch's steps drops the rest, max_tokens cuts a launch short (lengths 2 and 7 are not
    multiples of 2 or 3), and the cancelled request's later steps are dropped."""
    prompts = [[(13 * i + j) % 9000 for i in range(n)] for j, n in enumerate([5, 16, 33, 9])]
    lens = [12, 2, 7, 20]
    # request 3 ends at an "eos" mid-way: the step already in flight for it must be dropped
    plain3 = reference_generate(tiny_model.model, prompts[3], 20)
    eos = next(t for i, t in enumerate(plain3) if i >= 4 and t not in plain3[:i])
    loaded = dataclasses.replace(
        tiny_model, config=dataclasses.replace(tiny_model.config, eos_token_id=(eos,)))
    params = [SamplingParams(max_tokens=n) for n in lens]
    got, rt = asyncio.run(generate(loaded, 0, prompts, params, overlap=True, cancel=2,
                                   decode_steps_per_launch=per_launch))
    for i, (prompt, n) in enumerate(zip(prompts, lens)):
        ref = reference_generate(tiny_model.model, prompt, n, {eos})
        assert got[i] == (ref[:3] if i == 2 else ref)
    assert rt.pool.blocks.num_free == rt.opts.num_blocks
    st = rt.stats  # the step cadence counters (tandem_worker_decode_*)
    assert st.decode_steps > 0 and st.decode_step_rows > st.decode_steps  # several requests per step
    assert 0 < st.decode_busy_steps < st.decode_steps and st.decode_step_seconds > 0
    # one step per call at 1; with more, most calls launched several (the batch shrinks to one
    # request near the end, which still takes per_launch steps a call until its eos)
    assert st.decode_launches == st.decode_steps if per_launch == 1 else st.decode_launches < st.decode_steps
    # rows × step time: between the mean batch's worth (1 row) and every row (all the steps' rows)
    assert st.decode_step_seconds < st.decode_row_seconds < st.decode_step_seconds * st.decode_step_rows
    assert st.decode_device_idle_seconds == 0.0  # CPU: no CUDA events, nothing timed


@pytest.mark.parametrize("per_launch", [1, 2, 4])
def test_overlap_sampling_equals_plain_loop(tiny_model, per_launch) -> None:
    """Seeded sampling gives the plain loop's tokens at any steps per launch: each step keeps
    its step index."""
    prompts = [[(29 * i + 1) % 9000 for i in range(20)], [4, 5, 6]]
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=5), SamplingParams(max_tokens=8)]
    plain, _ = asyncio.run(generate(tiny_model, 0, prompts, params))
    over, _ = asyncio.run(generate(tiny_model, 0, prompts, params, overlap=True,
                                   decode_steps_per_launch=per_launch))
    assert over == plain


@pytest.mark.parametrize("argv,env,want", [
    ([], None, False),
    (["--disable-overlap-schedule"], None, True),
    (["--no-disable-overlap-schedule"], "true", False),
    ([], "true", True),
])
def test_disable_overlap_flag_and_env(monkeypatch, argv, env, want) -> None:
    from cli import config
    from cli.flags import build
    from cli.main import build_parser
    from worker.host import WorkerOptions

    monkeypatch.delenv("TANDEM_DISABLE_OVERLAP_SCHEDULE", raising=False)
    if env is not None:
        monkeypatch.setenv("TANDEM_DISABLE_OVERLAP_SCHEDULE", env)
    parser = build_parser()
    args = parser.parse_args(["decode", *argv])
    config.apply(parser, args)
    assert build(WorkerOptions, args).disable_overlap_schedule is want


@pytest.mark.parametrize("value", [0, 5])
def test_steps_per_launch_out_of_range_names_the_flag(value) -> None:
    from worker.host import WorkerOptions

    with pytest.raises(ValueError, match="--decode-steps-per-launch must be in 1..4"):
        WorkerOptions(decode_steps_per_launch=value)


def test_bad_boolean_env_names_the_variable(monkeypatch) -> None:
    from cli import config
    from cli.main import build_parser

    monkeypatch.setenv("TANDEM_DISABLE_OVERLAP_SCHEDULE", "maybe")
    parser = build_parser()
    args = parser.parse_args(["decode"])
    with pytest.raises(config.ConfigError, match="TANDEM_DISABLE_OVERLAP_SCHEDULE"):
        config.apply(parser, args)


@pytest.mark.parametrize("per_launch", [1, 2, 4])
def test_overlap_retraction_loses_no_in_flight_token(tiny_model, per_launch) -> None:
    """A request retracted while its next token is in flight (the overlap loop launches step
    i + 1 before it post-processes step i) resumes from its last real token: every stream,
    greedy and seeded, equals the one of a pool large enough for all, no token lost or
    repeated, no block left behind."""
    prompts = [[(31 * i + 7 * j) % 9000 + 1 for i in range(16)] for j in range(4)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in range(3)]
    params.append(SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=3))
    roomy, _ = asyncio.run(generate(tiny_model, 0, prompts, params))
    # 9 blocks of 16 tokens: the four need 16 at full length, so the loop must retract
    tight, rt = asyncio.run(generate(tiny_model, 0, prompts, params, num_blocks=9, overlap=True,
                                     decode_steps_per_launch=per_launch))
    assert rt.stats.retractions > 0
    assert tight == roomy
    assert roomy[0] == reference_generate(tiny_model.model, prompts[0], 40)
    assert rt.pool.blocks.num_free == 9


class AbortedRpc(Exception):
    pass


class FakeContext:
    """What DecodeServicer._generate asks of its gRPC context."""

    def time_remaining(self):
        return None

    async def abort(self, code, details):
        raise AbortedRpc(code, details)


def test_admitted_request_waits_for_blocks_the_overlap_loop_still_holds(tiny_model) -> None:
    """Under the overlap loop a request that ends (or a lone one that yields its turn) gives its
    ticket back at once but its blocks only once the step in flight has completed. The request
    admitted in its place must wait for those blocks, not be refused with RESOURCE_EXHAUSTED
    because the pool is momentarily full while it is the only one admitted."""
    from common.pb.tandem.v1 import decode_pb2, discovery_pb2
    from common.pb.tandem.v1 import sampling_pb2 as spb
    from decode_worker.scheduler import DecodeScheduler, RunningRequest
    from decode_worker.overlap import overlap_loop
    from decode_worker.service import DecodeServicer
    from worker.host import WorkerOptions, WorkerRuntime
    from worker.peers import PeerDirectory

    async def main():
        rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, WorkerOptions(model=tiny_model.name, num_blocks=8),
                           tiny_model)
        sched = DecodeScheduler(rt)
        sched.overlap = overlap_loop(sched)  # its release hook (the loop itself is not started)
        servicer = DecodeServicer(rt, sched, PeerDirectory(tiny_model.name, tiny_model.fingerprint))
        adm = sched.admission  # budget: 7 of 8 blocks
        try:
            ticket = await adm.admit(96, 16)  # 7 blocks projected
            a = RunningRequest("a", list(range(1, 98)), 96, rt.pool.blocks.allocate(7), SamplingParams(max_tokens=16),
                               ticket=ticket)
            sched.running.append(a)
            prompt = [(11 * j) % 9000 + 1 for j in range(40)]  # 3 blocks: waits behind a
            gen = servicer._generate(decode_pb2.DecodeRequest(request_id="b", token_ids=prompt,
                                                              sampling=spb.SamplingParams(max_tokens=1)), FakeContext())
            first = asyncio.ensure_future(gen.__anext__())
            for _ in range(3):
                await asyncio.sleep(0)
            assert adm.queued == 1
            sched.overlap._inflight = ("a step that reads a's blocks",)
            sched._finish(a, None)  # a ends: its ticket goes now, its blocks after that step
            assert adm.queued == 0 and adm.admitted == 1 and rt.pool.blocks.num_free == 1
            for _ in range(5):  # b runs: the pool is short by a's blocks
                await asyncio.sleep(0)
            assert not first.done(), first.exception()
            sched.overlap._inflight = None  # the step completes: the loop frees a's blocks
            for block_ids in sched.overlap._deferred:
                rt.pool.free(block_ids)
            sched.overlap._deferred = []
            msg = await asyncio.wait_for(first, 30)
            assert len(msg.token_ids) == 1
            await gen.aclose()
            assert adm.admitted == 0 and rt.pool.blocks.num_free == 8
            sched.overlap._inflight = ("a step that never completes",)
            sched.failed = RuntimeError("decode loop failed")
            assert not sched.frees_pending()  # a failed loop frees nothing: nobody waits for it
        finally:
            await servicer.close()
            rt.close()

    asyncio.run(main())


async def _until_the_pool_ends(loaded, overlap: bool, per_launch: int):
    """One request whose KV outgrows a 2-block pool (admission would refuse it; here it is
    added directly): (the tokens it streamed, its error's status, free blocks at the end)."""
    from common.pb.tandem.v1 import discovery_pb2
    from decode_worker.scheduler import DecodeScheduler, RunningRequest
    from worker.host import WorkerOptions, WorkerRuntime

    rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, WorkerOptions(model=loaded.name, num_blocks=2,
                                                                decode_steps_per_launch=per_launch), loaded)
    sched = DecodeScheduler(rt)
    if overlap:
        sched.overlap = overlap_loop(sched)
    task = asyncio.create_task(sched.run())
    try:
        prompt = list(range(1, 21))
        blocks = rt.pool.allocate_prompt(prompt)
        await rt.prefill(blocks.block_ids, prompt, 0)
        rt.pool.commit_prompt(blocks)
        req = RunningRequest("r", prompt + [5], len(prompt), blocks.block_ids,
                             SamplingParams(max_tokens=40, ignore_eos=True))
        sched.add(req)
        tokens, error = [], None
        while error is None:
            msg = await asyncio.wait_for(req.out.get(), 30)
            if msg.token is not None:
                tokens.append(msg.token)
            error = msg.error
        for _ in range(100):
            if sched.overlap is None or sched.overlap.idle:
                break
            await asyncio.sleep(0.01)
        return tokens, error[0], rt.pool.blocks.num_free
    finally:
        task.cancel()
        rt.close()


@pytest.mark.parametrize("per_launch", [1, 2, 4])
def test_a_request_outgrowing_the_pool_gets_its_in_flight_tokens_first(tiny_model, per_launch) -> None:
    """The overlap loop ends a request whose next step cannot fit the whole pool only once its
    steps in flight are post-processed: it streams as many tokens as in the plain loop (the
    loop used to end it at once, dropping them: one token short, N − 1 more at N per launch)."""
    import grpc

    plain = asyncio.run(_until_the_pool_ends(tiny_model, False, 1))
    over = asyncio.run(_until_the_pool_ends(tiny_model, True, per_launch))
    assert plain[1] == over[1] == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the pool's 32 positions hold the 20-token prompt, the first token and 11 streamed ones;
    # the 12th streamed token's KV would be the 33rd
    assert over[0] == plain[0] and len(plain[0]) == 12
    assert over[2] == plain[2] == 2


@pytest.mark.parametrize("per_launch", [1, 2, 4])
def test_an_overcommitted_pool_under_the_overlap_loop_makes_progress(tiny_model, per_launch) -> None:
    """Five requests whose KV at full length is far beyond a 7-block pool, joining at different
    steps (admission would not allow this; here they are added directly). Blocks released while
    a step is in flight come back only once it completes: retraction used to count them as gone,
    retract every running request, resume them all at once and start over, with no token made.
    Every stream must equal the one of a pool large enough for all, and every block come back."""
    import random

    rnd = random.Random(202)
    prompts, params, joins = [], [], []
    for j in range(5):
        prompts.append([rnd.randint(1, 8999) for _ in range(rnd.randint(3, 30))])
        params.append(SamplingParams(max_tokens=rnd.randint(2, 40), ignore_eos=True) if rnd.random() < 0.5 else
                      SamplingParams(max_tokens=rnd.randint(2, 40), ignore_eos=True, temperature=0.9, seed=j))
        joins.append(rnd.choice([0, 0, 2, 5, 9]))
    roomy, _ = asyncio.run(generate(tiny_model, 0, prompts, params))
    tight, rt = asyncio.run(generate(tiny_model, 0, prompts, params, num_blocks=7, overlap=True, join_at=joins,
                                     decode_steps_per_launch=per_launch))
    assert tight == roomy
    assert rt.stats.retractions > 0 and rt.pool.blocks.num_free == 7
