"""Threads that run a worker's model calls, and the CUDA stream of a decode worker's local prefill.

A worker runs every forward on one model thread (`ModelLane`), so forwards never overlap and
the event loop keeps serving RPCs. A decode worker on CUDA has a second lane for its local
prefill (prompts the router sent without a prefill worker, re-prefills after retraction or
migration): an eager prefill forward spends most of its wall time launching kernels on the
host — tens of milliseconds for a few hundred tokens of an 8-layer model on an H200 — and on
the model thread no decode step could be launched meanwhile, so every running stream's
inter-token latency grew by that much for each prefill piece. On its own thread and stream
(`StreamForward`), the prefill's launches overlap the decode steps' graph replays, and the
replays run on a stream of higher priority (engine/graph_runner.py `PriorityReplay`). The two
threads share the GIL; worker processes run with a 0.2 ms switch interval by default (--gil-switch-interval-us), so a
decode step waits that long at most for the prefill thread to let go of it.

The KV pool is shared by both streams; each writes only blocks the loop thread handed it, and
the hand-offs are ordered: a prefill forward first waits for everything the model thread's
stream queued before it (a block freed after a finished request may still be written by a
step in flight), and it returns only once its own stream has run, with its output tensors
marked as used by that stream so the caching allocator does not hand their memory to the next
prefill while a decode-side kernel still reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)

class ModelLane:
    """One thread running model calls in submission order.

    Args:
        name: the thread's name prefix ("model", "prefill").
        device: a CUDA device to make current on the thread (None: leave as is).
    """

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        init = None
        if device is not None and device.type == "cuda" and device.index is not None:
            index = device.index  # (a thread starts on device 0 whatever the process set)
            init = lambda: torch.cuda.set_device(index)  # noqa: E731 - the executor's initializer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)
        self.submitted = 0  # written on the loop thread only
        self.started = 0  # written on the lane's thread only
        self.busy_since: float | None = None  # monotonic start of the call now running
        self.profile: Any = None  # worker.lane_profile.LaneProfile around a window of calls (--profile-dir)

    @property
    def waiting(self) -> int:
        """Calls submitted and not started yet."""
        return self.submitted - self.started

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the lane's thread. If the caller is cancelled, wait for fn to
        finish before re-raising, so the caller never frees blocks a forward still writes."""
        self.submitted += 1
        fut = asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """fn(*args) on the lane's thread from a thread without a loop: a concurrent Future."""
        return self._executor.submit(fn, *args)

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        self.started += 1
        profile = self.profile
        if profile is not None:
            profile.before()
        self.busy_since = time.monotonic()  # the watchdog reads it to spot a wedged forward
        try:
            return fn(*args)
        finally:
            self.busy_since = None
            if profile is not None:
                profile.after()

    def busy_for(self, now: float) -> float:
        """Seconds the running call has run (0 when idle)."""
        since = self.busy_since
        return 0.0 if since is None else now - since

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def green_stream(device: torch.device, num_sms: int) -> tuple[Any, torch.cuda.Stream]:
    """A CUDA stream on a green context of `num_sms` of the device's SMs: its kernels run on
    those SMs only, so kernels of other streams always find the rest free (a kernel, once it
    holds an SM, is never preempted; stream priorities only order what waits). The driver may
    round num_sms up to its SM-group granularity. torch.cuda.green_contexts (PyTorch 2.10+):
    `GreenContext.Stream()` where it exists, else a stream created while the green context is
    the thread's current one (a stream belongs to the context current at its creation).
    Returns (the green context, the stream): keep the context as long as the stream is used.

    Raises:
        ValueError: this PyTorch has no green contexts, or the driver refused num_sms.
    """
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError as exc:
        raise ValueError(f"--prefill-sm-count needs CUDA green contexts (PyTorch 2.10+ with CUDA 12.4+): {exc}") from None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=index)
    except Exception as exc:  # noqa: BLE001 - the driver's refusal (or no CUDA at all), named
        raise ValueError(f"--prefill-sm-count {num_sms}: no green context of that many SMs on cuda:{index}: "
                         f"{type(exc).__name__}: {exc}") from None
    if hasattr(ctx, "Stream"):
        stream = ctx.Stream()
    else:
        ctx.set_context()
        try:
            stream = torch.cuda.Stream(device)
        finally:
            ctx.pop_context()
    return ctx, stream


class StreamForward:
    """A prefill forward run on a CUDA stream of its own, ordered with the model thread's stream.

    Args:
        forward: batch -> list of (tensor, tensor | None) per chunk (`ModelRunner.prefill_batch`).
        device: the CUDA device; its default stream is the model thread's.
        num_sms: > 0: the stream is on a green context of that many SMs (`green_stream`,
            --prefill-sm-count); 0: an ordinary stream sharing every SM.
    """

    def __init__(self, forward: Callable[[Any], list[tuple[torch.Tensor, torch.Tensor | None]]],
                 device: torch.device, num_sms: int = 0) -> None:
        self._forward, self.device = forward, device
        if num_sms > 0:
            self._green, self.stream = green_stream(device, num_sms)
            log.info("local prefill on a green context of %d of the GPU's %d SMs (--prefill-sm-count)", num_sms,
                     torch.cuda.get_device_properties(device).multi_processor_count)
        else:
            self.stream = torch.cuda.Stream(device)  # priority 0: below the decode graphs' replays

    def __call__(self, batch: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """On the prefill lane's thread: the forward, complete on the device when it returns."""
        main = torch.cuda.default_stream(self.device)
        self.stream.wait_stream(main)  # blocks handed over may still be written by a queued step
        with torch.cuda.stream(self.stream):
            out = self._forward(batch)
        for pair in out:
            for t in pair:
                if t is not None:
                    t.record_stream(main)  # read there next: the allocator waits for that too
        self.stream.synchronize()
        return out
