"""Signal handling for the staged lifecycle: the first SIGTERM/SIGINT asks to drain and
stop, a second one exits at once (DESIGN.md section 3, "Draining")."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Callable


def install_stop_signals(stop: asyncio.Event, on_second: Callable[[], None] | None = None) -> Callable[[], None]:
    """Set `stop` on SIGTERM/SIGINT; on a second signal call `on_second` (if given) and exit
    with status 1 at once. Returns a function restoring the previous handlers.

    Outside the main thread (tests running servers in threads) nothing is installed.
    """
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
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
