"""engine/device_clock.py: the prefill forwards' device time."""

import threading
import time

import pytest
import torch

from engine.device_clock import ForwardClock


def test_cpu_calls_count_their_wall_time_and_failures_raise_uncounted():
    clock = ForwardClock(torch.device("cpu"))
    assert clock.seconds() == 0.0
    assert clock.wrap(lambda x: (time.sleep(0.02), x + 1)[1])(1) == 2
    first = clock.seconds()
    assert 0.015 < first < 1.0
    with pytest.raises(ValueError):
        clock.timed(lambda: (time.sleep(0.01), int("x")))
    assert clock.seconds() == first


def test_reads_from_other_threads_add_each_call_once():
    clock = ForwardClock(torch.device("cpu"))
    stop = threading.Event()
    reads = []

    def reader():
        while not stop.is_set():
            reads.append(clock.seconds())

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(20):
        clock.timed(time.sleep, 0.001)
    stop.set()
    t.join()
    total = clock.seconds()
    assert reads == sorted(reads) and total >= 0.02
    assert clock.seconds() == total  # reading again adds nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (events on the forward's stream)")
def test_cuda_counts_the_device_time_once_the_work_finished():
    dev = torch.device("cuda")
    clock = ForwardClock(dev)
    a = torch.randn(4096, 4096, device=dev)
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):  # warm up first: the clock times from its first event to its
        a @ a                         # last, and the process's first GEMM on a stream spends host
    stream.synchronize()              # time (cuBLAS set-up) between them (0.26 s on an H100)
    with torch.cuda.stream(stream):  # the events go on the stream the forward runs on
        clock.timed(lambda: [a @ a for _ in range(20)])
    stream.synchronize()
    with torch.cuda.stream(stream):  # a later forward drains the finished ones (no scrape needed)
        clock.timed(lambda: None)
    assert len(clock._pending) <= 1
    stream.synchronize()
    seconds = clock.seconds()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    alone = time.perf_counter() - began
    assert 0.5 * alone < seconds < 2.0 * alone + 1e-3
