"""The overlap scheduler (docs/architecture.md, "Decode runtime"): while the device runs step i,
the CPU post-processes step i − 1 and schedules step i + 1.

Loop: schedule step i + 1 (its input token for a request still waiting on step i is the
placeholder of step i's future-map slot) → one model-thread call that launches step i + 1 and
then waits for step i (the only wait, on step i's event) → post-process step i → repeat. So the
device always has the next step queued behind the current one and never waits for a host round
trip, and the event loop hands the model thread one job per step (each hand-over waits for the
event loop's turn, which the streams of every running request share).

With --decode-steps-per-launch N > 1, one model-thread call queues up to N steps back to back
(step j's input token for a request is the placeholder of its step j − 1): the host's per-step
work (the hand-over to the model thread, scheduling, post-processing, a session message per
step) is paid once per launch where the host, not the device, sets the pace. A request joins at
the next launch; one that ends (eos, a stop string's cancel) in the first of a launch's steps
still takes a row in the others, whose tokens are dropped; the launch stops short where a
request's max_tokens or the free KV blocks end. Every token is the one the one-step loop gives
(same inputs, same step index for seeded sampling).

Consequences handled here:
- A request finishing at step i (eos) may already be in step i + 1: that token is dropped.
- Blocks released while a step is in flight (finished or cancelled requests) are freed only
  after that step has completed, so a new prompt's KV (written by a transfer) can never land
  in a block a running step still writes.
- A request whose last allowed token is in flight is not scheduled again.
- Blocks for a launch's later steps are taken when the launch is planned; a launch whose next
  step would need more blocks than are free stops before it (retraction plans the first step
  only, so a launch never causes a retraction one step at a time would not).

On a CPU the device is the calling thread: each launch computes at once and the steps run
sequentially; the loop is then off by default (--disable-overlap-schedule has no effect there)
and the plain loop runs. With MTP (`--speculative-num-steps k`) the loop is
decode_worker/spec_overlap.py's, whose steps resolve a variable number of tokens per request
on the device (`decode_loop` picks the scheduler's loop; on the fast path MTP keeps that loop,
in turn, with --disable-overlap-schedule).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.pb.tandem.v1 import sampling_pb2
from engine.overlap_runner import OverlapRunner
from engine.runner import DecodeInput
from engine.sampling import StepTokens, for_row

if TYPE_CHECKING:
    from decode_worker.scheduler import DecodeScheduler, RunningRequest
    from engine.overlap_runner import LaunchedStep

log = logging.getLogger(__name__)


def use_overlap(runtime, speculative: bool) -> bool:
    """Whether the decode loop overlaps steps (plain or MTP); the reason is logged either way."""
    if runtime.opts.disable_overlap_schedule:
        log.info("overlap scheduler: off (--disable-overlap-schedule)")
        return False
    if getattr(runtime, "engine", None) is not None:
        log.info("overlap scheduler: off with expert-parallel ranks (each step is one lock-step call "
                 "over the ranks' pipes; their runners keep no future-token map)")
        return False
    if runtime.pool.kv.device.type != "cuda":
        log.info("overlap scheduler: off on %s (steps run synchronously there; schedule, run and "
                 "postprocess take turns)", runtime.pool.kv.device.type)
        return False
    if speculative and not hasattr(runtime.runner, "spec_step"):
        log.info("overlap scheduler: off with MTP speculative decoding on this runner (expert-parallel "
                 "ranks run engine/spec_decode.py's host-side steps)")
        return False
    log.info("overlap scheduler: on (%s, device sampling)",
             "MTP steps with device-resident accept lengths" if speculative else "future-token map")
    return True


def overlap_loop(scheduler: DecodeScheduler, overlapped: bool = True):
    """The overlap loop for scheduler: MTP steps (decode_worker/spec_overlap.py) when it
    decodes speculatively, one token per step otherwise. overlapped=False (MTP only): the
    same device-resident MTP steps, post-processed in turn."""
    if scheduler.spec is not None:
        from decode_worker.spec_overlap import SpecOverlapLoop
        return SpecOverlapLoop(scheduler, overlapped)
    assert overlapped, "the plain loop is the one-token loop without overlap"
    return OverlapLoop(scheduler)


def decode_loop(scheduler: DecodeScheduler, runtime):
    """The loop object the scheduler runs, or None for its own plain loop (logged by use_overlap):
    the overlap loop where it is on; MTP on the fast path without overlap keeps the
    device-resident MTP steps (fast forwards, CUDA graphs), post-processed in turn."""
    loop = None
    if use_overlap(runtime, scheduler.spec is not None):
        loop = overlap_loop(scheduler)
    elif scheduler.spec is not None and getattr(runtime.runner, "fast", False) and hasattr(runtime.runner, "spec_step"):
        loop = overlap_loop(scheduler, overlapped=False)
    n = runtime.opts.decode_steps_per_launch
    if isinstance(loop, OverlapLoop):
        log.info("decode steps per launch: %d (--decode-steps-per-launch)", n)
    elif n != type(runtime.opts).decode_steps_per_launch:  # said only when asked for (not the default)
        log.info("--decode-steps-per-launch %d: no effect (it applies to the overlap loop without MTP; "
                 "each step launches alone here)", n)
    return loop


class DeferredFrees:
    """What both overlap loops share: blocks released while a step is in flight are freed only
    once it has completed (`_deferred`, freed by the loop after post-processing that step)."""

    def __init__(self, scheduler: DecodeScheduler) -> None:
        self.sched = scheduler
        self._inflight = None  # the step in flight (its loop's own tuple), or None
        self._deferred: list[list] = []  # block lists to free once the step in flight is done
        self._settling = False  # a completed step's post-processing and frees are under way
        scheduler.release = self._release  # hook: the scheduler frees blocks through us

    @property
    def pending_blocks(self) -> int:
        """Blocks released while the step in flight runs: free once it has completed."""
        return sum(map(len, self._deferred))

    @property
    def idle(self) -> bool:
        """No step in flight and no block waiting to be freed."""
        return self._inflight is None and not self._deferred and not self._settling

    def _release(self, block_ids: list) -> None:
        if self._inflight is None:
            self.sched.rt.pool.free(block_ids)
        else:
            self._deferred.append(block_ids)


class OverlapLoop(DeferredFrees):
    """The one-token overlap loop; `steps_per_launch` steps per model-thread call at most
    (--decode-steps-per-launch)."""

    def __init__(self, scheduler: DecodeScheduler) -> None:
        super().__init__(scheduler)
        rt = scheduler.rt
        self.steps_per_launch = rt.opts.decode_steps_per_launch
        self.runner = OverlapRunner(rt.runner, rt.opts.max_running, self.steps_per_launch)
        self.fmap = self.runner.fmap
        # the launch in flight: per step, (its requests, their slots, the launched step)
        self._inflight: list[tuple[list[RunningRequest], list[int], LaunchedStep]] | None = None

    def _schedule(self) -> list[RunningRequest]:
        # a request whose last allowed token is in flight waits for its post-processing
        return [r for r in self.sched._schedule() if r.generated < r.params.max_tokens]

    def _plan(self, batch: list[RunningRequest]) -> list[tuple[list[RunningRequest], list[int], list[DecodeInput],
                                                                list]]:
        """The launch's steps: (requests, slots, inputs, sampling) each. Each step's placeholders
        are appended to its requests' tokens as it is planned (the next step's inputs name them).
        Step 0 runs the whole batch (_schedule gave it its blocks); a later step runs the rows
        still below max_tokens, and only if their new blocks are free (taken here)."""
        pool = self.sched.rt.pool
        steps, rows = [], batch
        for j in range(self.steps_per_launch):
            if j:
                rows = [r for r in rows if r.generated < r.params.max_tokens]
                if not rows or self.sched.retraction.blocks_for_next_step(rows) > pool.blocks.num_free:
                    break
                for r in rows:
                    pool.grow(r.block_ids, len(r.tokens))
            slots = self.fmap.reserve(len(rows))
            inputs = [DecodeInput(r.block_ids, len(r.tokens) - 1, r.tokens[-1]) for r in rows]
            sampling = [r.sampling_row() for r in rows]
            for r, slot in zip(rows, slots):
                r.tokens.append(self.fmap.placeholder(slot))
            steps.append((rows, slots, inputs, sampling))
        return steps

    async def run(self) -> None:
        sched, rt = self.sched, self.sched.rt
        while True:
            batch = self._schedule()
            plan = self._plan(batch) if batch else []  # (its block growth evicts cached blocks too)
            rt.events.publish()
            if not batch and self._inflight is None:
                sched._last_step = None
                self.runner.idle()
                sched._wake.clear()
                await sched._wake.wait()
                continue
            previous = self._inflight or []
            launched, results = await rt.run_model(self.runner.step, [(i, sl, sa) for _, sl, i, sa in plan],
                                                   [p[2] for p in previous])
            if plan:
                sched.count_launch([len(rows) for rows, *_ in plan])
            rt.stats.decode_launches += bool(plan)
            rt.stats.decode_device_wait_seconds = self.runner.device_wait_s
            rt.stats.decode_device_busy_seconds = self.runner.device_busy_s
            rt.stats.decode_device_idle_seconds = self.runner.device_idle_s
            deferred = self._deferred
            self._inflight = [(rows, slots, step) for (rows, slots, _, _), step in zip(plan, launched)] or None
            self._deferred, self._settling = [], True
            for (rows, slots, _), result in zip(previous, results):  # in launch order
                self._postprocess(rows, slots, result)
            for block_ids in deferred:  # their last reader (the previous launch) has completed
                rt.pool.free(block_ids)
            self._settling = False

    def _postprocess(self, batch: list[RunningRequest], slots: list[int], step: StepTokens) -> None:
        from decode_worker.scheduler import TokenOut  # circular: the scheduler imports us

        running = set(self.sched.running)
        for req, slot, token, logprob, top in zip(batch, slots, *step):
            if req not in running or req.cancelled:
                continue  # finished by an earlier token (its step's token is dropped) or cancelled
            idx = _last_index(req.tokens, self.fmap.placeholder(slot))
            req.tokens[idx] = token
            generated = idx + 1 - req.prompt_len
            reason = sampling_pb2.FINISH_REASON_UNSPECIFIED
            if token in self.sched.eos and not req.params.ignore_eos:
                reason = sampling_pb2.FINISH_REASON_EOS
            elif generated >= req.params.max_tokens:
                reason = sampling_pb2.FINISH_REASON_LENGTH
            req.send(TokenOut(token, logprob, for_row(top, req.params)), self.sched.stream_interval)
            if reason != sampling_pb2.FINISH_REASON_UNSPECIFIED:
                del req.tokens[idx + 1:]  # a placeholder of the step now in flight, if any
                self.sched._finish(req, TokenOut(finish_reason=reason))


def _last_index(tokens: list[int], value: int) -> int:
    """Index of value's last occurrence, scanning from the end (a step's placeholder is among
    the last 2 × steps-per-launch entries: at most one later launch is in flight)."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(f"placeholder {value} not in the request's tokens")
