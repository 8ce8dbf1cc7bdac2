"""Drive a DecodeScheduler directly (no gRPC): local prefill, then one continuous batch."""

from __future__ import annotations

import asyncio

from common.pb.tandem.v1 import discovery_pb2
from common.sampling_params import SamplingParams
from decode_worker.overlap import overlap_loop
from decode_worker.scheduler import DecodeScheduler, RunningRequest
from engine.kv_pool import PoolExhausted
from engine.sampling import sample
from worker.host import WorkerOptions, WorkerRuntime


async def generate(loaded, k: int, prompts: list[list[int]], params: list[SamplingParams],
                   num_blocks: int = 256, overlap: bool | str = False, cancel: int | None = None,
                   join_at: list[int] | None = None, tops: list[list] | None = None,
                   **worker_options) -> tuple[list[list[int]], WorkerRuntime]:
    """Prefill each prompt locally, then decode all of them in one continuous batch with
    --speculative-num-steps k (overlap: force the overlap loop, decode_worker/spec_overlap.py's
    for k > 0, even on a CPU; otherwise the scheduler decides, on with a CUDA model unless
    disable_overlap_schedule=True; "in turn": decode_worker/spec_overlap.py's loop without
    overlap, as on the fast path with --disable-overlap-schedule). Request number `cancel` is cancelled after its third token. join_at[i]: request i is prefilled
    and added once the loop has launched that many steps (default: all at once). tops: where
    given, tops[i] gets each decoded token's `TokenOut.top` (the first token, sampled here, has
    none). Returns (tokens per request, runtime)."""
    rt = WorkerRuntime(discovery_pb2.ROLE_DECODE,
                       WorkerOptions(model=loaded.name, num_blocks=num_blocks, speculative_num_steps=k,
                                     **worker_options),
                       loaded)
    sched = DecodeScheduler(rt)
    if overlap and sched.overlap is None:
        sched.overlap = overlap_loop(sched, overlapped=overlap != "in turn")
    task = asyncio.create_task(sched.run())
    reqs, outs = [], []
    try:
        outs = [[] for _ in prompts]

        async def add(i: int) -> None:
            prompt, sp = prompts[i], params[i]
            idle = 0
            while join_at and sched.steps < join_at[i] and idle < 50:  # (not forever if the loop idles)
                idle = 0 if sched.running else idle + 1
                await asyncio.sleep(0.0005)
            while True:  # blocks held by retracted requests' re-prefills come back
                try:
                    blocks = rt.pool.allocate_prompt(prompt)
                    break
                except PoolExhausted:
                    await asyncio.sleep(0.002)
            hidden = await rt.prefill_hidden(blocks.block_ids, prompt, 0, mtp=k > 0)
            first, _ = sample(rt.runner.logits(hidden), sp, 0)
            rt.pool.commit_prompt(blocks)
            outs[i].append(first)
            if sp.max_tokens == 1:
                rt.pool.free(blocks.block_ids)
                return
            req = RunningRequest(f"r{i}", prompt + [first], len(prompt), blocks.block_ids, sp,
                                 hidden=hidden[None] if k else None)
            sched.add(req)
            reqs.append((req, outs[i], i))

        if join_at is None:  # in order, one after the other
            for i in range(len(prompts)):
                await add(i)
        else:  # concurrently, each once the loop has launched join_at[i] steps
            await asyncio.gather(*(add(i) for i in range(len(prompts))))
        for req, out, i in reqs:
            while True:
                msg = await asyncio.wait_for(req.out.get(), 60)
                assert msg.error is None, msg.error
                if msg.token is not None:
                    out.append(msg.token)
                    if tops is not None:
                        tops[i].append(msg.top)
                if msg.finish_reason:
                    break
                if req.request_id == f"r{cancel}" and len(out) == 3:
                    sched.cancel(req)
                    break
        for _ in range(100):  # the loop frees a cancelled request's blocks between steps
            if not sched.running and (sched.overlap is None or sched.overlap.idle):
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        rt.close()
    return outs, rt


def reference_draws(model, prompt: list[int], max_tokens: int, params: SamplingParams,
                    eos_token_ids=frozenset(), rows: list | None = None, generated: list[int] = (),
                    history: list[int] | None = None) -> list[int]:
    """reference_generate drawing as `sample` does with params, its logit bias and penalties
    applied here from their definition (OpenAI's: a token generated c times so far loses
    frequency × c + presence × [c > 0]) to the reference's own logits; rows: where given, each
    draw's adjusted logits are appended to it. generated: tokens generated before (a migrated
    request's: the prompt ends with them; the draws' step indices continue after them, and
    the penalties count them unless `history` says otherwise)."""
    from dataclasses import replace

    import torch

    from engine.reference import reference_generate
    plain = replace(params, logit_bias=(), presence_penalty=0.0, frequency_penalty=0.0)
    history = list(generated if history is None else history)

    def draw(row, step):
        step += len(generated)
        row = row.clone()
        for t, b in params.logit_bias:
            row[t] += b
        counts = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=row.shape[0]).float()
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        if rows is not None:
            rows.append(row)
        token = sample(row, plain, step)[0]
        history.append(token)
        return token
    return reference_generate(model, prompt, max_tokens, eos_token_ids, sample_fn=draw)
