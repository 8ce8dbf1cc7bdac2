"""Timing work captured in a CUDA graph, for the benchmark scripts: the replay's device time
from CUDA events, so no launch overhead of the host is counted (as in a decode step, which is
one graph replay)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

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
