"""Decode steps for the overlap scheduler: launch without waiting, collect later.

`launch` runs one `ModelRunner.decode_step` with the step's placeholder input ids resolved from
the FutureTokenMap on the device (so step i + 1 can be launched before step i's tokens reach the
host), writes the sampled tokens into the map and starts a non-blocking copy of tokens and
log-probabilities to pinned host memory with an event behind it. `collect` waits for that event
only. Sampling (greedy and seeded) runs on the device (engine/sampling.py): no step syncs. On a
CPU every call runs to completion at once, so the same code path works, sequentially.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from engine.future_map import FutureTokenMap
from engine.runner import DecodeInput, ModelRunner


@dataclass
class LaunchedStep:
    """A step in flight: host buffers filled once `event` has completed."""

    tokens: torch.Tensor  # [B] int64, host (pinned on CUDA)
    logprobs: torch.Tensor  # [B] float32, host
    event: torch.cuda.Event | None  # None on CPU: already complete


class OverlapRunner:
    def __init__(self, runner: ModelRunner, capacity: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.fmap = FutureTokenMap(capacity, self.device)
        self.cuda = self.device.type == "cuda"

    @torch.inference_mode()
    def launch(self, batch: list[DecodeInput], slots: list[int],
               sampling: list[tuple[SamplingParams, int]]) -> LaunchedStep:
        """Start one decode step; its token for batch[i] lands in future-map slot slots[i].

        sampling[i] = (params, step index) of the token batch[i] generates.
        """
        tokens, logprobs = self.runner.decode_step(batch, sampling, resolve=self.fmap.resolve)
        slot_t = torch.tensor(slots, dtype=torch.long, pin_memory=self.cuda).to(self.device, non_blocking=True)
        self.fmap.store(slot_t, tokens)
        if not self.cuda:
            return LaunchedStep(tokens, logprobs, None)
        host_t = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_l = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
        host_t.copy_(tokens, non_blocking=True)
        host_l.copy_(logprobs, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedStep(host_t, host_l, event)

    @staticmethod
    def collect(step: LaunchedStep) -> tuple[list[int], list[float]]:
        """Wait for a launched step and return its tokens and log-probabilities."""
        if step.event is not None:
            step.event.synchronize()
        return step.tokens.tolist(), step.logprobs.tolist()


@dataclass
class LaunchedSpecStep:
    """A speculative step in flight: `host` [B, 2(k+1) + 1] float64 (tokens, logprobs, count per
    row) filled once `event` has completed."""

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
        both = torch.cat((res.tokens.double(), res.logprobs.double(), res.count.double()[:, None]), 1)
        if not self.cuda:
            return LaunchedSpecStep(both, self.slots.k, None)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedSpecStep(host, self.slots.k, event)

    @staticmethod
    def collect(step: LaunchedSpecStep) -> list[list[tuple[int, float]]]:
        """Wait for a launched step; per row, its emitted (token, logprob) pairs (1..k+1)."""
        if step.event is not None:
            step.event.synchronize()
        k1 = step.k + 1
        out = []
        for row in step.host.tolist():
            c = int(row[-1])
            out.append([(int(t), lp) for t, lp in zip(row[:c], row[k1:k1 + c])])
        return out
