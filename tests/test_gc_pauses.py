"""common/gc_pauses.py: the start-up heap frozen only in a server's own process, and collections timed."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

from common import gc_pauses


def test_clock_counts_and_times_collections_by_generation() -> None:
    clock = gc_pauses.GcClock().install()
    try:
        gc.collect(2)
        gc.collect(0)
        assert clock.collections[2] >= 1 and clock.collections[0] >= 1
        assert clock.seconds[2] > 0.0
        before = list(clock.collections)
    finally:
        clock.uninstall()
    gc.collect(2)
    assert clock.collections == before  # uninstalled: no longer counted
    assert gc_pauses.process_clock() is gc_pauses.process_clock()  # one per process


def test_a_server_inside_another_program_leaves_its_heap_unfrozen(monkeypatch) -> None:
    # an in-process server (tests, tools): freezing would keep the host program's cycles for good
    monkeypatch.setattr(gc_pauses, "_OWNS_PROCESS", False)
    before = gc.get_freeze_count()
    assert gc_pauses.freeze_startup_heap() == 0
    assert gc.get_freeze_count() == before


def test_a_server_process_freezes_what_is_alive_and_still_collects_new_cycles() -> None:
    code = textwrap.dedent("""
        import gc
        from common import gc_pauses
        startup = [[i] for i in range(50000)]  # long-lived start-up objects
        gc_pauses.own_process()
        frozen = gc_pauses.freeze_startup_heap()
        assert frozen == gc.get_freeze_count() and frozen >= 50000, frozen
        class Node: pass
        a, b = Node(), Node()
        a.peer, b.peer = b, a  # a cycle allocated after the freeze
        del a, b
        assert gc.collect() >= 2  # still found and freed
        print("ok", frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


def test_a_worker_freezes_before_its_server_starts_unless_told_not_to(tiny_model, monkeypatch) -> None:
    import asyncio

    import worker.host as host
    from common.pb.tandem.v1 import discovery_pb2

    events: list[str] = []
    monkeypatch.setattr(host, "freeze_startup_heap", lambda: events.append("freeze") or 0)
    real_start = host.start_server

    async def start_server(*args, **kwargs):
        events.append("server")
        return await real_start(*args, **kwargs)

    monkeypatch.setattr(host, "start_server", start_server)

    async def serve(freeze: bool) -> None:
        rt = host.WorkerRuntime(discovery_pb2.ROLE_DECODE, host.WorkerOptions(
            model=tiny_model.name, num_blocks=8, port=0, gc_freeze=freeze), tiny_model)
        stop = asyncio.Event()
        task = asyncio.create_task(host.serve_worker(rt, [], [], ready=lambda s: stop.set(), stop=stop))
        await asyncio.wait_for(task, 30)

    asyncio.run(serve(True))
    assert events == ["freeze", "server"]  # nothing served yet when the heap is frozen
    events.clear()
    asyncio.run(serve(False))
    assert events == ["server"]  # --no-gc-freeze
