"""Decode steps for the overlap scheduler: launch without waiting, collect later.

`launch` builds the step's inputs on a side CUDA stream (so their host-to-device copies do not
queue behind the step still running on the main stream), resolves placeholder input ids from
the FutureTokenMap on the device, runs the forward, picks greedy tokens on the device, writes
them into the map and starts a non-blocking copy of tokens and log-probabilities to pinned host
memory with an event behind it. `collect` waits for that event only. On a CPU every call runs
to completion at once, so the same code path works, sequentially.

Requests with temperature > 0 are sampled with engine.sampling's CPU-seeded (seed, step)
streams, which are reproducible on any device; on CUDA such a step therefore copies those rows'
logits to the host (one sync in that step), greedy rows never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from engine.future_map import FutureTokenMap
from engine.kv_pool import KvPool, PagedKvCache
from engine.runner import DecodeInput
from engine.sampling import sample


@dataclass
class LaunchedStep:
    """A step in flight: host buffers filled once `event` has completed."""

    tokens: torch.Tensor  # [B] int64, host (pinned on CUDA)
    logprobs: torch.Tensor  # [B] float32, host
    event: torch.cuda.Event | None  # None on CPU: already complete


class OverlapRunner:
    def __init__(self, model: torch.nn.Module, pool: KvPool, capacity: int) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.kv.device
        self.fmap = FutureTokenMap(capacity, self.device)
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None

    def _inputs(self, batch: list[DecodeInput], slots: list[int]):
        lt = lambda xs: torch.tensor(xs, dtype=torch.long, pin_memory=self.cuda).to(  # noqa: E731
            self.device, non_blocking=True)
        ids = lt([b.input_token for b in batch])
        positions = lt([b.num_computed for b in batch])
        kv = PagedKvCache(self.pool, [(b.block_ids, b.num_computed, 1) for b in batch])
        return ids, positions, kv, lt(slots)

    @torch.inference_mode()
    def launch(self, batch: list[DecodeInput], slots: list[int],
               sampling: list[tuple[SamplingParams, int]]) -> LaunchedStep:
        """Start one decode step; its token for batch[i] lands in future-map slot slots[i].

        sampling[i] = (params, step index) of the token batch[i] generates.
        """
        if self.cuda:
            with torch.cuda.stream(self.side):
                ids, positions, kv, slot_t = self._inputs(batch, slots)
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.side)
            # made on the side stream, read on the main one: keep the caching allocator from
            # handing their memory to the next step's inputs before this step has run
            for t in (ids, positions, slot_t, kv._w_blk, kv._w_off, *(tab for tab, _ in kv._reads)):
                t.record_stream(main)
        else:
            ids, positions, kv, slot_t = self._inputs(batch, slots)
        ids = self.fmap.resolve(ids)  # placeholders of the step before -> its tokens, on device
        hidden = self.model(ids, positions, [1] * len(batch), kv)  # [B, hidden]
        logits = self.model.logits(hidden)  # [B, vocab] float32
        tokens = torch.argmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        sampled = [i for i, (p, _) in enumerate(sampling) if not p.greedy]
        if sampled:  # CPU-seeded streams: reproducible everywhere, at the price of one sync
            rows = logits[sampled].cpu()
            picks = [sample(rows[j], *sampling[i]) for j, i in enumerate(sampled)]
            idx = torch.tensor(sampled, device=self.device)
            tokens[idx] = torch.tensor([t for t, _ in picks], device=self.device)
            logprobs[idx] = torch.tensor([lp for _, lp in picks], device=self.device)
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
