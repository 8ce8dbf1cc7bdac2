"""A CUDA MPS control daemon of one local cluster (`tandem up --mps`).

Without MPS, the CUDA contexts of two processes on one GPU take turns: while the prefill
worker's kernels run, none of the decode worker's do, and each decode step waits out the
prefill forwards that fall inside it. Under MPS (NVIDIA's Multi-Process Service) the workers'
kernels run side by side on the GPU's multiprocessors, as kernels of one process on two streams
would. MPS is NVIDIA's own answer for several processes sharing a GPU; this class only starts
its control daemon for the cluster's processes and stops it with them.

The daemon gets a pipe and a log folder of its own under the cluster's log folder, so it
neither meets nor stops a daemon someone else runs on the machine; only processes started with
`env()` (the cluster's workers) become its clients. `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in a
client's environment caps the share of the GPU's multiprocessors its kernels may occupy
(`env(sm_percent=...)`): a prefill worker held to part of the GPU cannot crowd out the decode
steps. Sources: NVIDIA's "Multi-Process Service" guide (sections on the control daemon,
CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """The MPS control daemon could not be started (no binary, or it refused)."""


class MpsDaemon:
    """Start (`start`) and stop (`stop`) one MPS control daemon whose pipe and logs live in
    `folder` (created; folder/pipe, folder/log). `env(sm_percent)` is what a client process
    needs in its environment. Raises MpsError from `start` when `nvidia-cuda-mps-control` is not
    on PATH or exits non-zero (its log's last lines in the message)."""

    def __init__(self, folder: str | Path, control: str = CONTROL) -> None:
        self.folder = Path(folder)
        self.pipe = self.folder / "pipe"
        self.log = self.folder / "log"
        self.control = control
        self.running = False

    def env(self, sm_percent: int | None = None) -> dict[str, str]:
        """Variables that make a process this daemon's client; sm_percent (1..100) caps the
        share of multiprocessors its kernels may use."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)}
        if sm_percent is not None and sm_percent < 100:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(sm_percent)
        return env

    def _run(self, stdin: str | None, *args: str) -> subprocess.CompletedProcess:
        binary = shutil.which(self.control)
        if binary is None:
            raise MpsError(f"--mps: {self.control} is not on PATH (it ships with NVIDIA's driver; MPS needs a "
                           "CUDA GPU); start without --mps")
        return subprocess.run([binary, *args], input=stdin, text=True, capture_output=True, timeout=30,
                              env={**os.environ, **self.env()})

    def start(self) -> None:
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.log.mkdir(parents=True, exist_ok=True)
        r = self._run(None, "-d")
        if r.returncode != 0:
            tail = (self.log / "control.log").read_text(errors="replace")[-500:] if (self.log / "control.log").exists() else ""
            raise MpsError(f"--mps: {self.control} -d exited {r.returncode}: {(r.stderr or r.stdout).strip()[:300]} "
                           f"{tail}".strip())
        self.running = True

    def stop(self) -> None:
        """Ask the daemon to quit (it ends its server once the clients have exited); idempotent."""
        if not self.running:
            return
        self.running = False
        try:
            self._run("quit\n")
        except (MpsError, OSError, subprocess.TimeoutExpired):
            pass  # nothing more to do: the daemon is gone or unreachable
