"""Model lanes (worker/model_lane.py): calls in order on their own thread, a cancelled caller
waits for its call, the watchdog's busy time; on CUDA (skipped without: run on the lent H200),
a prefill on its own lane and stream beside graph-replayed decode steps on the model lane gives
the same logits and KV as each alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from worker.model_lane import ModelLane

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")


def test_lane_runs_calls_in_order_on_its_own_thread() -> None:
    lane = ModelLane("t")
    seen: list[tuple[int, str]] = []

    def call(i: int) -> int:
        time.sleep(0.01)
        seen.append((i, threading.current_thread().name))
        return i * i

    async def main() -> list[int]:
        tasks = [asyncio.create_task(lane.run(call, i)) for i in range(5)]
        await asyncio.sleep(0)
        assert lane.waiting >= 1  # submitted, not all started
        return await asyncio.gather(*tasks)

    try:
        assert asyncio.run(main()) == [0, 1, 4, 9, 16]
        assert [i for i, _ in seen] == list(range(5))
        assert {name for _, name in seen} != {threading.current_thread().name}
        assert len({name for _, name in seen}) == 1 and lane.waiting == 0
    finally:
        lane.shutdown()


def test_cancelled_caller_waits_for_its_call_and_busy_time_shows() -> None:
    lane = ModelLane("t")
    release, done = threading.Event(), threading.Event()

    def slow() -> None:
        release.wait(5)
        done.set()

    async def main() -> None:
        task = asyncio.create_task(lane.run(slow))
        await asyncio.sleep(0.05)
        assert lane.busy_for(time.monotonic()) >= 0.04
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting for the call: its blocks are being written
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done.is_set() and lane.busy_for(time.monotonic()) == 0.0

    try:
        asyncio.run(main())
    finally:
        lane.shutdown()


@cuda
@pytest.mark.parametrize("num_sms", [0, 16])
def test_prefill_lane_beside_graph_decode_steps_changes_nothing(num_sms: int) -> None:
    # num_sms 16: the prefill on a green context of 16 SMs (--prefill-sm-count)
    from engine.kv_pool import KvPool, KvPoolConfig
    from engine.model_source import TINY, load_model
    from engine.runner import DecodeInput, ModelRunner, PrefillInput
    from worker.model_lane import StreamForward
    loaded = load_model(TINY, dtype=torch.bfloat16)
    c = loaded.config
    model = loaded.model.to("cuda")
    pool = KvPool(KvPoolConfig(num_blocks=400, block_size=16, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                               dtype=torch.bfloat16), 1, "cuda")
    pool.kv.normal_(0, 0.5)
    runner = ModelRunner(model, pool)
    runner.warm_up_prefill()
    runner.capture_graphs(max_batch=8, max_context=2048)
    lens = [3, 40, 100, 17, 250]
    tables = [pool.blocks.allocate(pool.blocks_for(n + 1)) for n in lens]
    batch = [DecodeInput(t, n, 5 + i) for i, (t, n) in enumerate(zip(tables, lens))]
    prompt = [1 + (i * 37) % (c.vocab_size - 2) for i in range(1024)]
    p_table = pool.blocks.allocate(pool.blocks_for(len(prompt)))
    chunks = [(s, s + 256) for s in range(0, 1024, 256)]
    before = pool.kv.clone()

    def decode_steps(n: int) -> list[torch.Tensor]:
        return [runner.decode(batch).float().cpu() for _ in range(n)]

    def prefill(forward) -> torch.Tensor:
        out = None
        for s, e in chunks:
            out = forward([PrefillInput(p_table, prompt, s, e, logits=e == len(prompt))])
        return out[0][1].float().cpu()

    alone_steps = decode_steps(30)
    alone_logits = prefill(runner.prefill_batch)
    alone_kv = pool.kv[p_table].clone()
    pool.kv.copy_(before)
    torch.cuda.synchronize()

    model_lane, prefill_lane = ModelLane("model", torch.device("cuda")), ModelLane("prefill", torch.device("cuda"))
    forward = StreamForward(runner.prefill_batch, torch.device("cuda"), num_sms)

    async def both() -> tuple[list[torch.Tensor], torch.Tensor]:
        return await asyncio.gather(model_lane.run(decode_steps, 30), prefill_lane.run(prefill, forward))

    try:
        steps, logits = asyncio.run(both())
    finally:
        model_lane.shutdown()
        prefill_lane.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(alone_steps, steps))
    if num_sms == 0:
        assert torch.equal(alone_logits, logits)
        assert torch.equal(alone_kv, pool.kv[p_table])
    else:  # fewer SMs may change a GEMM's split, not its result beyond rounding
        torch.testing.assert_close(logits, alone_logits, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(pool.kv[p_table].float(), alone_kv.float(), atol=2e-2, rtol=2e-2)


def test_prefill_sm_count_is_checked() -> None:
    from worker.host import WorkerOptions
    from worker.model_lane import green_stream
    with pytest.raises(ValueError, match="--prefill-sm-count must be >= 0"):
        WorkerOptions(prefill_sm_count=-1)
    if not torch.cuda.is_available():  # no green context without CUDA: a named error, not a crash
        with pytest.raises(ValueError, match="--prefill-sm-count 16"):
            green_stream(torch.device("cuda:0"), 16)
