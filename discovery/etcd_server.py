"""A real etcd child process on loopback, for tests and `tandem up`.

`EtcdServer` starts the `etcd` binary found on PATH on free 127.0.0.1 ports with its data in a
temporary folder, waits until it answers on `/health`, and stops it by killing its process group.
`restart()` stops the process and starts a new one on the SAME ports and data dir, which is how
tests simulate a brief etcd outage.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Callable

from common.tls import TlsFiles

logger = logging.getLogger(__name__)

_INSTALL_HINT = "install the `etcd-server` Debian package (apt-get install etcd-server)"


class EtcdNotFoundError(FileNotFoundError):
    """The `etcd` binary is not on PATH."""


class EtcdStartError(RuntimeError):
    """etcd exited early or did not answer in time; the message carries its log tail."""


def find_etcd_binary() -> str:
    """Return the path of `etcd` on PATH.

    Raises:
        EtcdNotFoundError: no `etcd` on PATH (the message says to install `etcd-server`).
    """
    path = shutil.which("etcd")
    if path is None:
        raise EtcdNotFoundError(f"the etcd binary was not found on PATH; {_INSTALL_HINT}")
    return path


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to send the child SIGTERM when its parent thread ends; None
    where prctl is not found. Looked up before the fork: the function the child runs between
    fork and exec only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong]
    pr_set_pdeathsig, sigterm, parent = 1, int(signal.SIGTERM), os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _free_port() -> int:
    # Another process may take the port between close() and etcd's bind; start() retries then.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """One single-member etcd on loopback.

    Args:
        binary: path of the etcd binary; default: `etcd` on PATH.
        startup_timeout: seconds to wait for etcd to answer `/health` after spawning it.
        stop_timeout: seconds to wait after SIGTERM before SIGKILL.
        tls: etcd's certificate and key and the CA (common/certs.py issues them): serve clients
            over TLS and take only clients with a certificate of that CA (--client-cert-auth),
            on the peer port as well (etcd serves its client API there too); `endpoint` is then
            "https://127.0.0.1:port". None: plaintext.
        parent_dir: the folder its temporary folder (data and etcd.log, removed by stop()) is
            made in; default the system's temporary folder.
        stop_with_parent: on Linux, the kernel sends etcd SIGTERM when the thread that started
            it ends (PR_SET_PDEATHSIG): from a process's main thread, when the process is gone,
            SIGKILL included (`tandem up`). Elsewhere, or False: etcd outlives a killed parent.

    Usable as a (sync or async) context manager, or through start()/stop().
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        startup_timeout: float = 20.0,
        stop_timeout: float = 5.0,
        tls: TlsFiles | None = None,
        parent_dir: str | None = None,
        stop_with_parent: bool = False,
    ) -> None:
        self._binary = binary
        self._parent_dir = parent_dir
        self._stop_with_parent = stop_with_parent
        self._tls = tls
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._root: Path | None = None  # temp folder holding data/ and etcd.log
        self._client_port: int | None = None
        self._peer_port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- properties -------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The client endpoint, "127.0.0.1:port" or with tls "https://127.0.0.1:port" (valid
        once started; kept across restart())."""
        if self._client_port is None:
            raise RuntimeError("EtcdServer has not been started")
        return f"{'https://' if self._tls else ''}127.0.0.1:{self._client_port}"

    @property
    def data_dir(self) -> Path:
        """The etcd data folder (kept across restart(), removed by stop())."""
        if self._root is None:
            raise RuntimeError("EtcdServer has not been started")
        return self._root / "data"

    @property
    def running(self) -> bool:
        """True while the etcd process is alive."""
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn etcd and block until it answers (at most `startup_timeout` seconds).

        The first start picks free ports and a temp folder; later starts (see restart()) reuse
        them, so clients reconnect to the same endpoint and find the same data.

        Raises:
            EtcdNotFoundError: no etcd binary.
            EtcdStartError: etcd exited or did not answer in time.
        """
        if self.running:
            return
        binary = self._binary or find_etcd_binary()
        first_start = self._root is None
        if first_start:
            self._root = Path(tempfile.mkdtemp(prefix="tandem-etcd-", dir=self._parent_dir))
        # Fresh ports only on the first start: a port stolen between probe and bind shows up as
        # an early exit, so retry a couple of times with new ports.
        attempts = 3 if first_start else 1
        for attempt in range(attempts):
            if first_start:
                self._client_port, self._peer_port = _free_port(), _free_port()
            try:
                self._spawn(binary)
                self._wait_ready()
                logger.info("etcd ready on %s (data in %s)", self.endpoint, self.data_dir)
                return
            except EtcdStartError:
                self._kill()
                if attempt + 1 == attempts:
                    if first_start:
                        self._remove_root()
                    raise
                logger.warning("etcd failed to start (attempt %d), retrying", attempt + 1)

    def stop(self) -> None:
        """Kill etcd's process group (SIGTERM, then SIGKILL) and remove its data folder."""
        self._kill()
        self._remove_root()

    def restart(self, downtime: float = 0.0) -> None:
        """Stop the process, stay down `downtime` seconds, start again on the same port and data.

        Raises:
            EtcdStartError: the new process did not come up.
        """
        self._kill()
        if downtime > 0:
            time.sleep(downtime)
        self.start()

    def stop_process(self) -> None:
        """Stop the process only (ports and data kept); start() brings it back."""
        self._kill()

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EtcdServer:
        # start() blocks while polling /health; keep the event loop free.
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    # -- internals --------------------------------------------------------------------------

    def _spawn(self, binary: str) -> None:
        assert self._root is not None
        client_url = f"{'https' if self._tls else 'http'}://127.0.0.1:{self._client_port}"
        peer_url = f"{'https' if self._tls else 'http'}://127.0.0.1:{self._peer_port}"
        name = "tandem"
        args = [
            binary,
            f"--name={name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={name}={peer_url}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self._tls:  # clients over TLS with certificates of the cluster CA, on the peer port too:
            # etcd serves its whole client API (gRPC) there as well, so a plaintext peer listener,
            # even on loopback, would take any local process's writes
            args += [f"--cert-file={self._tls.cert}", f"--key-file={self._tls.key}",
                     f"--trusted-ca-file={self._tls.ca}", "--client-cert-auth",
                     f"--peer-cert-file={self._tls.cert}", f"--peer-key-file={self._tls.key}",
                     f"--peer-trusted-ca-file={self._tls.ca}", "--peer-client-cert-auth"]
        with open(self._root / "etcd.log", "ab") as log:
            # Own session: stop() can kill the whole process group.
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=_parent_death_signal() if self._stop_with_parent else None,
            )
        logger.debug("spawned etcd pid %d on %s", self._proc.pid, client_url)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        url = f"{'https' if self._tls else 'http'}://127.0.0.1:{self._client_port}/health"
        context = None
        if self._tls:  # etcd's own certificate is a client one of the same CA too
            context = ssl.create_default_context(cafile=self._tls.ca)
            context.load_cert_chain(self._tls.cert, self._tls.key)
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with status {self._proc.returncode}:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass  # not listening yet, or no leader yet
            time.sleep(0.05)
        raise EtcdStartError(
            f"etcd did not answer on {url} within {self._startup_timeout} s:\n{self._log_tail()}"
        )

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=self._stop_timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()  # reap it, or Popen.__del__ warns (ResourceWarning)
        logger.info("stopped etcd pid %d", proc.pid)

    def _remove_root(self) -> None:
        root, self._root = self._root, None
        self._client_port = self._peer_port = None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def _log_tail(self, lines: int = 20) -> str:
        assert self._root is not None
        try:
            text = (self._root / "etcd.log").read_text(errors="replace")
        except OSError:
            return "(no etcd log)"
        return "\n".join(text.splitlines()[-lines:])
