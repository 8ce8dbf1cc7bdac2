"""Signal handling for the staged lifecycle: the first SIGTERM/SIGINT asks to drain and
stop, a second one exits at once (docs/operations.md, draining); child processes that exit with
their worker; processes `tandem up` started that stop when it is gone."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


# Set by the first stop signal, or once the handlers are restored at the end: the process's own
# stop is under way (stop_with_launcher then sends no SIGTERM of its own, which would count as a
# second signal and exit at once, or, with the handlers gone, kill it mid-cleanup)
STOPPING = threading.Event()


def install_stop_signals(stop: asyncio.Event, on_second: Callable[[], None] | None = None) -> Callable[[], None]:
    """Set `stop` on SIGTERM/SIGINT; on a second signal call `on_second` (if given) and exit
    with status 1 at once. Returns a function restoring the previous handlers.

    Outside the main thread (tests running servers in threads) nothing is installed.
    """
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        STOPPING.set()
        if stop.is_set():
            if on_second is not None:
                on_second()
            os._exit(1)
        stop.set()

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def restore() -> None:
        STOPPING.set()  # the process is past serving: its stop is its own from here
        for sig in installed:
            loop.remove_signal_handler(sig)

    return restore


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until event is set; False if timeout_s seconds passed first (a drain's bound)."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    except (TimeoutError, asyncio.TimeoutError):
        return False


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> threading.Thread:
    """In a child process a worker spawned (a pipeline stage, an expert-parallel rank): exit at
    once (status 1) when the process parent_pid is gone, so that a worker killed or stopped
    during its start-up leaves no process behind. Daemon children are ended by their parent's
    normal exit only, and a worker waiting for its children in a collective's set-up cannot run
    a signal handler until that wait ends. Polls os.getppid() every poll_s seconds (a child is
    re-parented when its parent dies): Linux's PR_SET_PDEATHSIG would fire when the parent's
    spawning thread ends, not the process. Also ignores SIGINT (see below). Returns the watching
    thread (a daemon)."""

    # Ctrl-C in a terminal reaches the whole process group: the worker stops its children itself
    # (a child taking the SIGINT would die mid-step with a traceback instead)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return _watch_parent(parent_pid, poll_s, "exit-with-parent", lambda: os._exit(1))


def _watch_parent(parent: int, poll_s: float, name: str, gone: Callable[[], None],
                  until: threading.Event | None = None) -> threading.Thread:
    """A daemon thread `name` that polls os.getppid() every poll_s seconds and calls `gone()`
    once this process's parent is no longer `parent` (it was re-parented: the parent died);
    it ends without calling it once `until` is set."""

    def watch() -> None:
        while os.getppid() == parent:
            if until is not None and until.wait(poll_s):
                return
            if until is None:
                time.sleep(poll_s)
        gone()

    t = threading.Thread(target=watch, name=name, daemon=True)
    t.start()
    return t


LAUNCHER_ENV = "TANDEM_LAUNCHER_PID"  # set by cli.cluster.LocalCluster(stop_with_launcher=True)


def stop_with_launcher(poll_s: float = 1.0) -> threading.Thread | None:
    """In a router or worker process `tandem up` (or `tandem demo`) started: when that launcher
    is gone without stopping its cluster (SIGKILL, the OOM killer), send this process SIGTERM
    once, so that its own staged stop drains and exits as if the launcher had stopped it, rather
    than keep holding its port, GPU memory and discovery record. The launcher names itself in
    TANDEM_LAUNCHER_PID; the variable is taken out of os.environ, so that processes this one
    starts do not watch the launcher (they watch this process: `exit_with_parent`). Polls
    os.getppid() every poll_s seconds (a child is re-parented when its parent dies), and ends
    once the process's own stop is under way (STOPPING: a stop signal came). Returns the
    watching thread (a daemon), or None when no launcher is named."""
    value = os.environ.pop(LAUNCHER_ENV, "")
    if not value.isdigit():
        return None
    launcher = int(value)

    def gone() -> None:
        if STOPPING.is_set():  # a stop signal came between the last poll and now
            return
        log.warning("the launcher (pid %d) is gone without stopping this process: stopping", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    # stopping already (the launcher's SIGTERM): nothing to add
    return _watch_parent(launcher, poll_s, "stop-with-launcher", gone, until=STOPPING)
