"""Decode steps for the overlap scheduler: launch without waiting, collect later.

`launch` runs one `ModelRunner.decode_step` whose placeholder input ids are resolved from the
runner's FutureTokenMap on the device (so step i + 1 can be launched before step i's tokens
reach the host) and whose sampled tokens go into the map at the step's slots, then starts one
non-blocking copy of its tokens and log-probabilities into one of a few pinned host buffers
reused in turn (a step's buffer is written again only after that step has been collected),
with an event behind it. `collect` waits for that event only. `step` does both in one call
(launch the next steps, then collect the previous ones), so the scheduler hands the model
thread one job per launch: one step, or up to `steps_per_launch` steps queued back to back
(--decode-steps-per-launch), each step's inputs resolved on the device from the step before
it. Sampling (greedy
and seeded) runs on the device (engine/sampling.py): no step syncs. On a CPU every call runs to
completion at once, so the same code path works, sequentially.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from engine.runner import DecodeInput, ModelRunner
from engine.sampling import StepTokens, top_pairs, unpack_step


MAX_STEPS_PER_LAUNCH = 4  # --decode-steps-per-launch's upper bound (the staging rings' depth assumes it)


@dataclass
class LaunchedStep:
    """A step in flight: `host` [B, 2 + 2K] float64 rows (`pack_step`) filled once `event` completed."""

    host: torch.Tensor  # [B, 2 + 2K] float64: (token id, logprob, K top ids, K top logprobs) per row
    event: torch.cuda.Event | None  # None on CPU: already complete
    began: torch.cuda.Event | None = None  # recorded before the step's first kernel (timing on)


class OverlapRunner:
    """Launch and collect decode steps for decode_worker/overlap.py.

    Args:
        runner: the model runner (its future map holds the steps' tokens).
        max_batch: the largest batch of one step.
        steps_per_launch: the most steps one `step` call launches (1..MAX_STEPS_PER_LAUNCH).

    Raises:
        ValueError: steps_per_launch out of range, or a future map too small for two launches'
            placeholders (2 × steps_per_launch × max_batch slots).
    """

    def __init__(self, runner: ModelRunner, max_batch: int, steps_per_launch: int = 1) -> None:
        self.runner = runner
        self.device = runner.device
        self.fmap = runner.future
        if not 1 <= steps_per_launch <= MAX_STEPS_PER_LAUNCH:
            raise ValueError(f"steps per launch must be in 1..{MAX_STEPS_PER_LAUNCH}, got {steps_per_launch}")
        self.steps_per_launch = steps_per_launch
        alive = 2 * steps_per_launch  # two launches' steps hold placeholders at once
        if self.fmap.capacity < alive * max_batch:
            raise ValueError(f"future map of {self.fmap.capacity} slots is too small for {alive} steps "
                             f"of up to {max_batch} rows")
        self.cuda = self.device.type == "cuda"
        self.device_wait_s = 0.0  # seconds collect spent waiting for the device, in total
        # device seconds the collected steps ran, from CUDA events around each step (so the
        # device's busy share of wall time tells a host-bound loop from a device-bound one)
        self.device_busy_s = 0.0
        # device seconds between one collected step's end (its copy event) and the next collected
        # step's start (its `began`): the stream ran nothing of the loop's then, waiting for the
        # host to queue the step (the next plan's upload, queued before `began`, counts here too)
        self.device_idle_s = 0.0
        self._last_end: torch.cuda.Event | None = None
        # turns, each a pinned [max_batch, 2] float64 buffer a step's result lands in and its
        # two timing events (step start, copy done), made once and used again: a `step` call
        # launches at most steps_per_launch steps and then collects the previous call's, so
        # 2 × steps_per_launch turns are in use at once and one more keeps a turn from being
        # written while its step's result is still being read
        self._turns = ([(torch.empty((max_batch, 2), dtype=torch.float64, pin_memory=True),
                         torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(2 * steps_per_launch + 1)] if self.cuda else [])
        self._launches = 0

    @torch.inference_mode()
    def launch(self, batch: list[DecodeInput], slots: list[int],
               sampling: list[tuple[SamplingParams, int]]) -> LaunchedStep:
        """Start one decode step; its token for batch[i] lands in future-map slot slots[i].

        sampling[i] = (params, step index) of the token batch[i] generates.
        """
        if not self.cuda:  # (a copy: a graph's output, were one replayed, changes at the next step)
            return LaunchedStep(self.runner.decode_step(batch, sampling, slots).clone(), None)
        ring, began, event = self._turns[self._launches % len(self._turns)]
        self._launches += 1
        both = self.runner.decode_step(batch, sampling, slots, began)  # [B, 2 (+ 2K)] float64 on the device
        host = (ring[: len(batch)] if len(batch) <= ring.shape[0] and both.shape[1] == ring.shape[1]
                else torch.empty(both.shape, dtype=both.dtype, pin_memory=True))  # (top log-probs: wider)
        host.copy_(both, non_blocking=True)
        event.record()
        return LaunchedStep(host, event, began)

    def collect(self, step: LaunchedStep) -> StepTokens:
        """Wait for a launched step and return its tokens, log-probabilities and top
        log-probabilities (the wait's
        seconds are added to `device_wait_s`: the host had nothing left to do but wait)."""
        if step.event is not None:
            t0 = time.perf_counter()
            step.event.synchronize()
            self.device_wait_s += time.perf_counter() - t0
            # the step's kernels queue behind the previous step's: its device time starts at
            # `began` (recorded once the host had planned the step, just before its forward was
            # queued; reached once the stream got there) and ends at `event`: a host that queues
            # the step late leaves the device idle, and that wait is not counted as busy
            self.device_busy_s += step.began.elapsed_time(step.event) / 1e3
            if self._last_end is not None:
                self.device_idle_s += max(0.0, self._last_end.elapsed_time(step.began)) / 1e3
            self._last_end = step.event
        return unpack_step(step.host)

    def idle(self) -> None:
        """The loop has no step to run and waits for work: the gap before its next step is no
        wait for the host, so it is not counted in `device_idle_s`."""
        self._last_end = None

    def step(self, steps: list[tuple[list[DecodeInput], list[int], list[tuple[SamplingParams, int]]]],
             previous: list[LaunchedStep]) -> tuple[list[LaunchedStep], list[StepTokens]]:
        """Launch `steps` (each (batch, slots, sampling) as `launch` takes them, queued in this
        order: a step's placeholder inputs may name the slots of an earlier one in the list),
        then collect `previous`: (the launched steps, previous's tokens and log-probabilities,
        in order).

        Raises:
            ValueError: more steps than steps_per_launch (their turns would overlap)."""
        if len(steps) > self.steps_per_launch:
            raise ValueError(f"{len(steps)} steps in one launch; at most {self.steps_per_launch}")
        launched = [self.launch(batch, slots, sampling) for batch, slots, sampling in steps]
        return launched, [self.collect(p) for p in previous]


@dataclass
class LaunchedSpecStep:
    """A speculative step in flight: `host` [B, 2(k+1) + 1 (+ (k+1) 2K)] float64 (tokens,
    logprobs, count per row; then, where a row asked for them, each position's top
    log-probabilities, `SpecResult.top`) filled once `event` has completed."""

    host: torch.Tensor
    k: int
    event: torch.cuda.Event | None  # None on CPU: already complete


class SpecOverlapRunner:
    """MTP speculative steps for the overlap scheduler (engine/spec_batch.py): each request's
    next input ids and length are resolved on the device from its slot, so `launch` never
    waits for the previous step; `collect` waits for one step's single device-to-host copy."""

    def __init__(self, runner: ModelRunner, capacity: int, k: int) -> None:
        from engine.spec_batch import SpecSlots
        self.runner = runner
        self.device = runner.device
        cfg = runner.model.config
        graphs = getattr(runner, "spec_graphs", None)
        if graphs is not None and graphs.slots.k == k and graphs.slots.num_free >= capacity:
            self.slots = graphs.slots  # the whole-step graphs read and write these (engine/spec_graphs.py)
        else:
            self.slots = SpecSlots(capacity, k, cfg.hidden_size, runner.model.dtype, self.device)
        self.cuda = self.device.type == "cuda"

    @torch.inference_mode()
    def init(self, slot: int, hidden: torch.Tensor, tokens: list[int]) -> None:
        """`SpecSlots.init` on the model thread (its copies are ordered behind steps in flight)."""
        self.slots.init(slot, hidden, tokens)

    @torch.inference_mode()
    def launch(self, rows) -> LaunchedSpecStep:
        """Start one speculative step for rows (engine.spec_batch.SpecRow)."""
        res = self.runner.spec_step(self.slots, rows)
        parts = [res.tokens.double(), res.logprobs.double(), res.count.double()[:, None]]
        if res.top is not None:
            parts.append(res.top.reshape(res.top.shape[0], -1))
        both = torch.cat(parts, 1)
        if not self.cuda:
            return LaunchedSpecStep(both, self.slots.k, None)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedSpecStep(host, self.slots.k, event)

    @staticmethod
    def collect(step: LaunchedSpecStep) -> list[list[tuple[int, float, tuple[tuple[int, float], ...]]]]:
        """Wait for a launched step; per row, its emitted (token, logprob, top) triples (1..k+1;
        top: the position's most likely (id, logprob) pairs, the step's K of them; () where no
        row of the step asked)."""
        if step.event is not None:
            step.event.synchronize()
        k1 = step.k + 1
        out = []
        for row in step.host.tolist():
            c = int(row[2 * k1])
            tops = top_pairs(row[2 * k1 + 1:], k1) if len(row) > 2 * k1 + 1 else [()] * k1
            out.append([(int(t), lp, top) for t, lp, top in zip(row[:c], row[k1:k1 + c], tops)])
        return out
