"""Device seconds of a worker's prefill forwards, for `tandem_worker_prefill_device_seconds_total`.

Where a prefill worker and a decode worker share one GPU, every second of the device that the
prefill forwards take is a second the decode steps cannot have: the prefill's device time over
a window is the share of the GPU that decoding lost to it. A forward's wall time on the host
says little about that (its launches return before the kernels run, and the host may wait for
the GIL), so on CUDA the clock records an event before and after each forward on the stream it
runs on and sums their elapsed times once the second event has completed; on a CPU the call is
synchronous and its wall time is the device time.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)


class ForwardClock:
    """Sums the device time of calls wrapped by `timed`.

    `timed` runs on the model thread (it records events on that thread's current stream);
    `seconds` may be called from any thread (the metrics scrape's): it adds the calls whose end
    event has completed and leaves the others for a later read, so a reading never waits for the
    device and never counts a forward twice.

    Args:
        device: the device the forwards run on (CUDA: events; otherwise wall time).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._seconds = 0.0
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()  # (start, end) CUDA events
        self._lock = threading.Lock()

    def timed(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), its device time counted once it returns (CUDA: the current stream's events
        around it). A call that raises is not counted (its events could not be trusted)."""
        if not self.cuda:
            began = time.perf_counter()
            out = fn(*args)
            with self._lock:
                self._seconds += time.perf_counter() - began
            return out
        stream = torch.cuda.current_stream(self.device)
        start = self._record(stream)
        out = fn(*args)
        end = self._record(stream) if start is not None else None
        with self._lock:
            if end is not None:
                self._pending.append((start, end))
            self._drain()  # here too: with no scrape (metrics off) the events must not pile up
        return out

    def _record(self, stream: Any) -> Any:
        """A timing event recorded on `stream`, or None once recording failed (a stream of a
        green context, --prefill-sm-count, may refuse an event of the primary context): the
        clock then stops counting rather than fail the forwards it times."""
        if not self.cuda:
            return None
        try:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            return event
        except RuntimeError as exc:
            log.warning("prefill device time not counted from here on: recording a CUDA event failed (%s)", exc)
            self.cuda = False
            self._seconds = float("nan")
            return None

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """fn with every call `timed`."""
        return lambda *args: self.timed(fn, *args)

    def seconds(self) -> float:
        """Device seconds of the calls finished on the device so far (NaN once recording failed)."""
        with self._lock:
            self._drain()
            return self._seconds

    def _drain(self) -> None:
        """Add the calls whose end event has completed (the lock held; one stream: in order)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._seconds += start.elapsed_time(end) / 1e3
