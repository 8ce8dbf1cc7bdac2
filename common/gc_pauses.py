"""Garbage-collector pauses in a serving process: freeze the start-up heap, time every collection.

CPython's collector stops the process's threads for every collection, and a collection of the
oldest generation walks every tracked container object that is alive: in a worker, the model's
modules, torch's and gRPC's module state, the KV pool's bookkeeping, hundreds of thousands of
objects that live as long as the process and are never garbage. On the GPU decode path a step
is one to a few milliseconds, so one full collection (tens of milliseconds with a model loaded)
idles the device for many steps. `freeze_startup_heap` moves everything alive once start-up is
done into the collector's permanent generation (`gc.freeze`), so later collections walk only
what the requests allocated since; those objects are still collected, and reference counting
frees the frozen ones as before (a cycle among frozen objects is never collected: start-up
objects are meant to live as long as the process). vLLM, SGLang and Ray Serve do the same after
their warm-up.

`GcClock` times every collection through `gc.callbacks` (the time between its "start" and
"stop" calls), per generation; `process_clock()` is the process's one clock, installed on first
use, which a worker's metrics install and export (tandem_worker_gc_collections / _gc_seconds).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


_OWNS_PROCESS = False  # set by the command-line entry point (cli/main.py): the process is a server's


def own_process() -> None:
    """Say that this process is a Tandem server's own (`tandem router|prefill|decode`): only then
    does `freeze_startup_heap` freeze. A server started inside another program (tests, tools)
    leaves that program's heap alone: freezing it would keep its cycles for good."""
    global _OWNS_PROCESS
    _OWNS_PROCESS = True


def freeze_startup_heap() -> int:
    """In a process `own_process` claimed: collect once (start-up's garbage is not kept), then
    freeze every object still alive. Returns the number of objects frozen
    (`gc.get_freeze_count()`); 0 and nothing done in another process."""
    if not _OWNS_PROCESS:
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d start-up objects frozen (gc.freeze; --no-gc-freeze leaves them tracked)",
             frozen)
    return frozen


class GcClock:
    """Collections and their seconds per generation (0, 1, 2) since `install`, from gc.callbacks.

    The callback runs in whichever thread triggered the collection, with the GIL held, and a
    process runs one collection at a time, so one start time serves; the counters are plain
    lists read by a scrape on another thread (a read may miss the collection in progress)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._began: float | None = None  # perf_counter at the running collection's "start"
        self._installed = False

    def install(self) -> GcClock:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:  # "stop" (a clock installed mid-collection skips that one)
            gen = info["generation"]
            self.collections[gen] += 1
            self.seconds[gen] += time.perf_counter() - self._began
            self._began = None


_PROCESS_CLOCK: GcClock | None = None


def process_clock() -> GcClock:
    """The process's GcClock (collections are per process, whatever runtimes it holds),
    installed the first time it is asked for."""
    global _PROCESS_CLOCK
    if _PROCESS_CLOCK is None:
        _PROCESS_CLOCK = GcClock().install()
    return _PROCESS_CLOCK
