"""common.lifecycle.exit_with_parent: a worker's child process (pipeline stage, EP rank) ends
when the worker is gone, even when the worker was killed during its start-up (real processes:
a parent that spawns a child the way the workers do, then is SIGKILLed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT = r"""
import multiprocessing as mp, os, sys, time
from common.lifecycle import exit_with_parent

def child(parent_pid):
    exit_with_parent(parent_pid, poll_s=0.1)
    time.sleep(60)

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(os.getpid(),), daemon=True)
    p.start()
    print(p.pid, flush=True)
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for this purpose (its parent, the test's parent process, may not reap it)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:  # reaped between the two looks
        return False


def test_child_ends_with_its_killed_parent(tmp_path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    child = -1
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert _alive(child), "the child ended while its parent was alive"
        parent.send_signal(signal.SIGKILL)  # no cleanup in the parent: what a kill mid start-up does
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its killed parent"
    finally:
        parent.kill()
        parent.wait(10)
        parent.stdout.close()
        if child > 0 and _alive(child):
            os.kill(child, signal.SIGKILL)
