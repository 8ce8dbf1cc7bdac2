"""A window of a worker's model calls under torch.profiler (--profile-dir, --profile-calls).

A served decode step can spend time the in-process step does not: on a GPU shared with a
prefill worker, the decode stream waits between its steps for reasons no host profile shows
(run 24: 1.2-1.8 ms a step of config M at concurrency 64). This records, on a running worker,
what its own stream did: once the worker serves (start-up's warm-up and graph captures done),
after SKIP model calls (a decode worker's calls are launches of up to --decode-steps-per-launch
steps, a prefill worker's are batched forwards) the next COUNT calls run under torch.profiler
with CPU and CUDA activity. When the window closes the worker writes, in DIR:
- `{role}-{lane}-{pid}.trace.json.gz`: the Chrome trace (chrome://tracing, Perfetto);
- `{role}-{lane}-{pid}.summary.json`: per CUDA stream, its busy and idle time between its
  first and last activity of the window, its kernels' and copies' time, and its longest gaps
  with the activity on either side (`gaps`).
Each worker records one window (a window still open when the worker stops writes nothing); the
profiler costs host time while it records, so figures of that window are not the served ones.
CUPTI records the whole process's device activity: a decode worker's local prefill stream
shows as a stream of its own, though its host calls are not counted or traced. Not yet run on
a GPU: its first GPU run shows whether the kernels replayed from the decode graphs (captured
before the window opens) appear in the trace. SGLang's /start_profile and vLLM's
VLLM_TORCH_PROFILER_DIR are the same idea.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

log = logging.getLogger(__name__)

TOP_GAPS = 20  # gaps listed per stream in the summary


def parse_calls(spec: str) -> tuple[int, int]:
    """--profile-calls "SKIP:COUNT" -> (skip, count). Raises ValueError naming the flag."""
    try:
        skip, count = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--profile-calls must be SKIP:COUNT (model calls to skip, then to record), got {spec!r}") \
            from None
    if skip < 0 or count < 1:
        raise ValueError(f"--profile-calls {spec}: SKIP must be >= 0 and COUNT >= 1")
    return skip, count


@dataclass(frozen=True)
class Activity:
    """One device activity of a trace: its CUDA stream, start and end (µs), name and kind
    ("kernel", "memcpy" or "memset")."""

    stream: int
    start_us: float
    end_us: float
    name: str
    kind: str


def _kind(name: str) -> str:
    low = name.lower()
    if low.startswith("memcpy"):  # (kineto's "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoD ...")
        return "memcpy"
    if low.startswith("memset"):
        return "memset"
    return "kernel"


def stream_summary(activities: Iterable[Activity], top: int = TOP_GAPS) -> dict[str, Any]:
    """Per stream: {"busy_us", "idle_us" (between its first start and last end, time no
    activity of that stream ran), "span_us", "kernel_us", "memcpy_us", "activities", "gaps":
    the `top` longest idle stretches, each {"us", "after", "before"} (the activities' names)}.
    Overlapping activities of one stream (not expected) count once."""
    by_stream: dict[int, list[Activity]] = defaultdict(list)
    for a in activities:
        by_stream[a.stream].append(a)
    out: dict[str, Any] = {}
    for stream, acts in sorted(by_stream.items()):
        acts.sort(key=lambda a: a.start_us)
        busy, idle, gaps = 0.0, 0.0, []
        kinds: dict[str, float] = defaultdict(float)
        end, last = acts[0].start_us, None
        for a in acts:
            kinds[a.kind] += a.end_us - a.start_us
            if a.start_us > end:
                idle += a.start_us - end
                gaps.append((a.start_us - end, last.name if last else "", a.name))
            busy += max(0.0, a.end_us - max(a.start_us, end))
            if a.end_us >= end:
                end, last = a.end_us, a
        gaps.sort(key=lambda g: -g[0])
        out[str(stream)] = {"activities": len(acts), "span_us": round(end - acts[0].start_us, 1),
                            "busy_us": round(busy, 1), "idle_us": round(idle, 1),
                            **{f"{k}_us": round(v, 1) for k, v in sorted(kinds.items())},
                            "gaps": [{"us": round(us, 1), "after": after[:120], "before": before[:120]}
                                     for us, after, before in gaps[:top]]}
    return out


def device_activities(prof: torch.profiler.profile) -> list[Activity]:
    """The CUDA activities (kernels, copies, sets) a finished torch.profiler window recorded."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if str(e.device_type()).split(".")[-1] != "CUDA":
            continue
        start = e.start_ns() / 1e3
        out.append(Activity(int(e.device_resource_id()), start, start + e.duration_ns() / 1e3, e.name(),
                            _kind(e.name())))
    return out


class LaneProfile:
    """torch.profiler around calls SKIP + 1 .. SKIP + COUNT of one model lane (`before` and
    `after` run on the lane's thread around each call), then the trace and its summary in
    `directory` (module docstring). Errors in writing are logged, never raised: profiling must
    not take a serving worker down."""

    def __init__(self, directory: str, calls: str, role: str, lane: str) -> None:
        self.skip, self.count = parse_calls(calls)
        self.directory = Path(directory)
        self.stem = f"{role}-{lane}-{os.getpid()}"
        self.calls = 0
        self._prof: torch.profiler.profile | None = None
        self._started = 0.0
        self.done = False  # the window has closed (or the profiler would not start)
        self.written = threading.Event()  # set once the window's files are written (or failed)

    def check_directory(self) -> None:
        """Make the directory if needed and check it can be written. Raises ValueError naming
        --profile-dir (a worker refuses to start rather than find out when the window closes)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".{self.stem}.probe"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"--profile-dir {self.directory}: cannot write there ({exc.strerror or exc})") from None

    def before(self) -> None:
        self.calls += 1
        if self.done or self._prof is not None or self.calls != self.skip + 1:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        except Exception as exc:  # noqa: BLE001 - a profiler that will not start is said, the call runs
            self.done = True
            log.warning("--profile-dir: the profiler did not start (%s: %s); model calls run unprofiled",
                        type(exc).__name__, exc)
            return
        self._prof, self._started = prof, time.perf_counter()
        log.info("profiling model calls %d..%d of this lane (--profile-calls)", self.calls,
                 self.skip + self.count)

    def after(self) -> None:
        if self._prof is None or self.calls < self.skip + self.count:
            return
        prof, self._prof, self.done = self._prof, None, True
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the window's kernels into the trace
            wall = time.perf_counter() - self._started
            prof.__exit__(None, None, None)  # (on the thread that started it)
        except Exception as exc:  # noqa: BLE001 - said, the worker serves on
            log.warning("--profile-dir: the profiler did not stop cleanly: %s: %s", type(exc).__name__, exc)
            return
        # the trace's export takes seconds for a long window: off the model thread, which has
        # steps to run
        threading.Thread(target=self._write, args=(prof, wall), name="profile-export", daemon=True).start()

    def _write(self, prof: torch.profiler.profile, wall: float) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            trace = self.directory / f"{self.stem}.trace.json.gz"
            prof.export_chrome_trace(str(trace))
            summary = {"calls": self.count, "first_call": self.skip + 1, "wall_s": round(wall, 4),
                       "streams": stream_summary(device_activities(prof))}
            (self.directory / f"{self.stem}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            log.info("profile of %d model calls written: %s and its .summary.json", self.count, trace)
        except Exception as exc:  # noqa: BLE001 - a failed write is said, the worker serves on
            log.warning("profile of the model calls not written to %s: %s: %s", self.directory,
                        type(exc).__name__, exc)
        finally:
            self.written.set()
