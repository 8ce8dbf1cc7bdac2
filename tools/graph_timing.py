"""Timing work captured in a CUDA graph, for the benchmark scripts: the replay's device time
from CUDA events, so no launch overhead of the host is counted (as in a decode step, which is
one graph replay). Also the scripts' result rows (`JsonRows`)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn run once on a side stream (compiles, allocates, warms up), then captured in a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, per_replay: int = 1, replays: int = 20) -> float:
    """Median µs of one of `per_replay` units a replay does, over `replays` timed replays."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_replay)
    return statistics.median(times)


class JsonRows(list):
    """A benchmark script's result rows: each printed as a JSON line when added (a device call
    cut short still leaves them in its log), all written as JSON lines by `write`."""

    def add(self, row: dict) -> dict:
        self.append(row)
        print(json.dumps(row), flush=True)
        return row

    def write(self, path: Path | None) -> None:
        """The rows to `path` as JSON lines (nothing without a path)."""
        if path:
            path.write_text("".join(json.dumps(r) + "\n" for r in self))
