"""A CUDA MPS control daemon of one local cluster (`tandem up --mps`).

Without MPS, the CUDA contexts of two processes on one GPU take turns: while the prefill
worker's kernels run, none of the decode worker's do, and each decode step waits out the
prefill forwards that fall inside it. Under MPS (NVIDIA's Multi-Process Service) the workers'
kernels run side by side on the GPU's multiprocessors, as kernels of one process on two streams
would. MPS is NVIDIA's own answer for several processes sharing a GPU; this class only starts
its control daemon for the cluster's processes and stops it with them.

The daemon gets a pipe and a log folder of its own (the logs under the cluster's log folder;
the pipe there too unless that path is too long for the daemon's unix sockets, then a short
folder under /tmp), so it neither meets nor stops a daemon someone else runs on the machine;
only processes started with `env()` (the cluster's workers) become its clients.
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in a client's environment caps the share of the GPU's
multiprocessors its kernels may occupy (`env(sm_percent=...)`): a prefill worker held to part of
the GPU cannot crowd out the decode steps. `CUDA_MPS_CLIENT_PRIORITY=1` (`env(below_normal=True)`)
makes a client's work "below normal": where both are ready, the GPU schedules the normal
clients' (the decode steps') first. Sources: NVIDIA's "Multi-Process Service" guide (the control
daemon, CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY, the `quit` command,
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_CLIENT_PRIORITY).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PERCENT_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIORITY_VAR = "CUDA_MPS_CLIENT_PRIORITY"  # 0 normal (the default), 1 below normal
CLIENT_VARS = (PERCENT_VAR, PRIORITY_VAR)  # what a client's environment may carry for one client only
# The daemon's longest socket is pipe/control_privileged; unix socket paths hold 107 bytes.
MAX_PIPE_PATH = 107 - len("/control_privileged")
START_TIMEOUT_S = 10.0  # for `-d` to return and the daemon to create its control socket
QUIT_TIMEOUT_S = 10.0


class MpsError(RuntimeError):
    """The MPS control daemon could not be started (no binary, it refused, or it never came up)."""


class MpsDaemon:
    """Start (`start`) and stop (`stop`) one MPS control daemon whose logs live in folder/log and
    whose pipe lives in folder/pipe (or a short folder under /tmp when that path would be too long
    for a unix socket). `env(sm_percent)` is what a client process needs in its environment.
    `start` raises MpsError, one line, when `nvidia-cuda-mps-control` is not on PATH, exits
    non-zero, hangs, or its control socket does not appear within START_TIMEOUT_S."""

    def __init__(self, folder: str | Path, control: str = CONTROL) -> None:
        self.folder = Path(folder).resolve()  # clients run in another working directory
        self.log = self.folder / "log"
        pipe = self.folder / "pipe"
        self.own_tmp_pipe = len(str(pipe)) > MAX_PIPE_PATH
        self.pipe = Path("/tmp") / f"tandem-mps-{uuid.uuid4().hex[:10]}" if self.own_tmp_pipe else pipe
        self.control = control
        self.running = False

    def env(self, sm_percent: int | None = None, below_normal: bool = False) -> dict[str, str]:
        """Variables that make a process this daemon's client; sm_percent (1..100) caps the
        share of multiprocessors its kernels may use; below_normal lowers its work's priority
        under the other clients'."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)}
        if sm_percent is not None and sm_percent < 100:
            env[PERCENT_VAR] = str(sm_percent)
        if below_normal:
            env[PRIORITY_VAR] = "1"
        return env

    def _run(self, stdin: str | None, *args: str, timeout: float) -> int:
        binary = shutil.which(self.control)
        if binary is None:
            raise MpsError(f"--mps: {self.control} is not on PATH (it ships with NVIDIA's driver; MPS needs a "
                           "CUDA GPU); start without --mps")
        # the caller's own SM cap would become the daemon's default for every client: not ours
        env = {k: v for k, v in os.environ.items() if k not in CLIENT_VARS}
        # no pipes for its output: `-d` forks the daemon, which would hold them open
        return subprocess.run([binary, *args], input=stdin, text=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout, env={**env, **self.env()}).returncode

    def start(self) -> None:
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.log.mkdir(parents=True, exist_ok=True)
        try:
            rc = self._run(None, "-d", timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            if self.own_tmp_pipe:
                shutil.rmtree(self.pipe, ignore_errors=True)
            why = f"did not return in {START_TIMEOUT_S:.0f} s" if rc is None else f"exited {rc}"
            raise MpsError(f"--mps: {self.control} -d {why}; {self._log_tail()}".rstrip("; "))
        self.running = True  # from here on stop() asks it to quit, whatever happens next
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.pipe / "control").exists():
            if time.monotonic() > deadline:
                self.stop()
                raise MpsError(f"--mps: the MPS control daemon made no control socket in {self.pipe} within "
                               f"{START_TIMEOUT_S:.0f} s; {self._log_tail()}".rstrip("; "))
            time.sleep(0.05)

    def _log_tail(self) -> str:
        """The last lines of the daemon's control.log on one line ("" when there is none)."""
        try:
            text = (self.log / "control.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-3:])[-300:]

    def _pid(self) -> int | None:
        for folder in (self.pipe, self.log):
            try:
                return int((folder / "nvidia-cuda-mps-control.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return None

    def stop(self) -> None:
        """Ask the daemon to quit (it ends its server once the clients have exited); when it does
        not answer within QUIT_TIMEOUT_S, SIGTERM its pid and log a warning. Idempotent."""
        if not self.running:
            return
        try:
            if self._run("quit\n", timeout=QUIT_TIMEOUT_S) != 0:
                raise OSError("quit failed")
        except (MpsError, OSError, subprocess.TimeoutExpired) as exc:
            pid = self._pid()
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pid = None
            logger.warning("MPS control daemon did not quit (%s); %s", type(exc).__name__,
                        f"sent SIGTERM to pid {pid}" if pid else f"it may still run with its pipe in {self.pipe}")
        self.running = False
        if self.own_tmp_pipe:
            shutil.rmtree(self.pipe, ignore_errors=True)
