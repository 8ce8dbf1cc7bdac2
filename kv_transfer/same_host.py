"""What the same-host backends (`shm`, `cuda-ipc`) share: peers, notifications, deadlines.

Two worker processes on one host map each other's KV pool (shared memory for host pools, CUDA
IPC handles for GPU pools), so a write is a plain copy into the peer's memory done by the
writer: no library, no staging, the copy bandwidth limit. What a subclass adds is only how a
pool is exported and opened (`_export`, `_open`) and how bytes are copied (`_copy`).

Notifications travel over a Unix stream socket in the abstract namespace (no file to clean
up): every agent listens on one, a writer connects once per peer (in `add_peer`), sends its
name, then one length-prefixed frame per notification, after the copy of that write (and of
every earlier write) has completed. The connection also tells the writer when the peer is
gone: the peer never sends on it, so a readable socket means end-of-file. A listener thread
per agent reads the frames, so notifications arrive whichever asyncio loop waits.

Metadata: JSON {backend, name, host, pid, socket, pool: [base, stride, device, blocks],
export: {...}}; `host` (hostname + kernel boot id) tells whether the peer is on this host.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from kv_transfer.base import (KvTransferAgent, PeerName, PoolDescriptor, RemoteBlocks,
                              TransferError, TransferResult, TransferTimeout, plan_write)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!I")
_MAX_FRAME = 1 << 20
_MAX_BUFFERED_NOTIFS = 4096  # as in the NIXL backend
_POLL_SLEEP_S = 0.0005


def host_id() -> str:
    """Identity of this host: hostname and kernel boot id (containers share the boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class Peer:
    """A peer's pool as this process sees it, and the socket notifications go out on."""

    name: str
    metadata: bytes
    pool: PoolDescriptor
    memory: Any  # subclass-defined: the peer's pool mapped here (a flat uint8 tensor)
    sock: socket.socket

    def alive(self) -> bool:
        """False once the peer closed its end (it exited or closed its agent)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            return not readable or self.sock.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False


class SameHostAgent(KvTransferAgent):
    """Base of the backends that copy straight into a peer's memory on the same host.

    Args:
        name: agent name, non-empty and unique among communicating workers.
    Raises:
        ValueError: empty name. TransferError: the notification socket cannot listen.
    """

    BACKEND = ""

    def __init__(self, name: str) -> None:
        if not name:
            raise ValueError("transfer agent name must be non-empty")
        self._name = PeerName(name)
        self._closed = False
        self._pool: PoolDescriptor | None = None
        self._pool_tensor: torch.Tensor | None = None
        self._export: dict[str, Any] = {}
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()  # guards the notification buffer and waiters
        self._notifs: dict[bytes, list[str]] = {}
        self._notif_count = 0
        self._waiters: dict[bytes, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[str]]]] = {}
        # Abstract socket names hold at most 107 bytes: the uuid makes it unique, not the name.
        self._address = f"\0tandem-kv/{name[:48]}/{os.getpid()}/{uuid.uuid4().hex[:12]}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self._address)
            self._listener.listen(64)
        except OSError as exc:
            self._listener.close()
            raise TransferError(f"cannot listen for notifications: {exc}") from exc
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, name=f"kv-notify-{name}", daemon=True).start()

    @property
    def name(self) -> PeerName:
        return self._name

    @property
    def backend(self) -> str:
        return self.BACKEND

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transfer agent {self._name!r} is closed")

    # --- what a subclass provides ---------------------------------------------------------------

    @abc.abstractmethod
    def _export_pool(self, tensor: torch.Tensor) -> dict[str, Any]:
        """JSON-able description that lets another process on this host open the pool;
        ValueError if this backend cannot serve the tensor (wrong device, not shared)."""

    @abc.abstractmethod
    def _open(self, export: dict[str, Any], pool: PoolDescriptor) -> Any:
        """Map a peer's pool here (the `memory` of its `Peer`); TransferError if impossible."""

    @abc.abstractmethod
    async def _copy(self, peer: Peer, runs: list[tuple[int, int, int]], deadline: float) -> None:
        """Copy every (src_offset, dst_offset, length) run from our pool into the peer's, and
        return only once the bytes are in the peer's memory and no copy is running any more.
        TransferTimeout past `deadline` (monotonic seconds), TransferError if the peer left."""

    # --- memory and peers -------------------------------------------------------------------------

    def register_pool(self, tensor: torch.Tensor) -> PoolDescriptor:
        self._check_open()
        if self._pool is not None:
            raise RuntimeError("a KV pool is already registered with this agent")
        if not tensor.is_contiguous() or tensor.numel() == 0 or tensor.dim() == 0:
            raise ValueError("KV pool must be a contiguous, non-empty tensor with a block dim")
        self._export = self._export_pool(tensor)
        self._pool_tensor = tensor
        self._pool = PoolDescriptor(base_address=tensor.data_ptr(),
                                    block_stride_bytes=tensor[0].numel() * tensor.element_size(),
                                    device_id=tensor.get_device(), num_blocks=tensor.shape[0])
        logger.info("%s: registered KV pool %s", self.BACKEND, self._pool)
        return self._pool

    def metadata(self) -> bytes:
        self._check_open()
        if self._pool is None:
            raise RuntimeError("register_pool before publishing metadata")
        return json.dumps({"backend": self.BACKEND, "name": self._name, "host": host_id(),
                           "pid": os.getpid(), "socket": self._address, "pool": list(self._pool),
                           "export": self._export}).encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._check_open()
        if not name or name == self._name:
            raise ValueError(f"invalid peer name {name!r} (empty or this agent's own)")
        old = self._peers.get(name)
        if old is not None and old.metadata == metadata:
            return
        try:
            md = json.loads(metadata)
            peer_name, backend, host = md["name"], md["backend"], md["host"]
            pool = PoolDescriptor(*(int(v) for v in md["pool"]))
            address, export = str(md["socket"]), dict(md["export"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"invalid {self.BACKEND} metadata for peer {name!r}: {exc}") from exc
        if peer_name != name:
            raise ValueError(f"metadata is for agent {peer_name!r}, not {name!r}")
        if backend != self.BACKEND:
            raise TransferError(f"peer {name!r} offers backend {backend!r}, not {self.BACKEND!r}")
        if host != host_id():
            raise TransferError(f"peer {name!r} is on another host ({host})")
        if self._pool is not None and pool.block_stride_bytes != self._pool.block_stride_bytes:
            raise TransferError(f"peer {name!r} has {pool.block_stride_bytes} B blocks, we have "
                                f"{self._pool.block_stride_bytes} B (different KV layouts)")
        memory = self._open(export, pool)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(address)
            _send_frame(sock, self._name.encode())
        except OSError as exc:
            sock.close()
            raise TransferError(f"cannot reach peer {name!r}'s notification socket: {exc}") from exc
        if old is not None:
            self.remove_peer(name)
        self._peers[name] = Peer(name, metadata, pool, memory, sock)
        logger.info("%s: added transfer peer %r", self.BACKEND, name)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def remove_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        # Copies in flight hold their own reference to the peer's memory: it stays mapped
        # until the last one ends.
        peer.sock.close()
        logger.info("%s: removed transfer peer %r", self.BACKEND, name)

    # --- writing ----------------------------------------------------------------------------------

    async def write_blocks(self, peer_name: str, src_block_ids: Sequence[int],
                           dst: RemoteBlocks, notification: bytes | None,
                           timeout_s: float) -> TransferResult:
        self._check_open()
        runs = plan_write(self._pool, src_block_ids, dst, notification, timeout_s)
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"unknown transfer peer {peer_name!r} (no metadata loaded)")
        remote = peer.pool
        if (dst.base_address != remote.base_address or dst.device_id != remote.device_id
                or any(not 0 <= b < remote.num_blocks for b in dst.block_ids)):
            raise TransferError(f"destination outside peer {peer_name!r}'s registered pool")
        if not peer.alive():
            raise TransferError(f"transfer peer {peer_name!r} disconnected")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if runs:
            await self._copy(peer, runs, deadline)
        if notification is not None:
            self._notify(peer, notification, deadline, timeout_s)
        total = sum(length for _, _, length in runs)
        return TransferResult(total, time.monotonic() - t0, len(runs), self.BACKEND)

    def _notify(self, peer: Peer, message: bytes, deadline: float, timeout_s: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"write to {peer.name!r} not done in {timeout_s} s")
        if not peer.alive():
            raise TransferError(f"transfer peer {peer.name!r} disconnected")
        try:
            peer.sock.settimeout(remaining)
            _send_frame(peer.sock, message)
        except TimeoutError:
            raise TransferTimeout(f"notification to {peer.name!r} not sent in {timeout_s} s") from None
        except OSError as exc:
            raise TransferError(f"notification to {peer.name!r} failed: {exc}") from exc

    # --- notifications ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                             name=f"kv-notify-{self._name}-conn").start()

    def _read_loop(self, conn: socket.socket) -> None:
        try:
            sender = _recv_frame(conn).decode()
            while True:
                self._deliver(sender, _recv_frame(conn))
        except (OSError, EOFError, UnicodeDecodeError):
            pass
        finally:
            conn.close()
            try:
                self._conns.remove(conn)
            except ValueError:
                pass

    def _deliver(self, sender: str, message: bytes) -> None:
        """From the reader thread (or the loop, re-delivering): to a waiter, or buffered."""
        with self._lock:
            waiters = self._waiters.get(message)
            if not waiters:
                self._notifs.setdefault(message, []).append(sender)
                self._notif_count += 1
                while self._notif_count > _MAX_BUFFERED_NOTIFS:
                    oldest = next(iter(self._notifs))
                    logger.warning("dropping unclaimed transfer notification %r", oldest)
                    senders = self._notifs[oldest]
                    senders.pop(0)
                    if not senders:
                        del self._notifs[oldest]
                    self._notif_count -= 1
                return
            loop, fut = waiters.pop(0)
            if not waiters:
                del self._waiters[message]
        try:
            loop.call_soon_threadsafe(self._resolve, fut, sender, message)
        except RuntimeError:  # the waiter's loop closed: keep it for another waiter
            self._deliver(sender, message)

    def _resolve(self, fut: asyncio.Future[str], sender: str, message: bytes) -> None:
        if fut.done():  # the waiter timed out meanwhile: the notification is not lost
            self._deliver(sender, message)
        else:
            fut.set_result(sender)

    async def wait_notification(self, message: bytes, timeout_s: float) -> PeerName:
        self._check_open()
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        message = bytes(message)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        with self._lock:
            senders = self._notifs.get(message)
            if senders:
                sender = senders.pop(0)
                if not senders:
                    del self._notifs[message]
                self._notif_count -= 1
                return PeerName(sender)
            self._waiters.setdefault(message, []).append((loop, fut))
        try:
            return PeerName(await asyncio.wait_for(fut, timeout_s))
        except TimeoutError:
            raise TransferTimeout(f"no notification {message!r} within {timeout_s} s") from None
        finally:
            with self._lock:
                waiters = self._waiters.get(message, [])
                if (loop, fut) in waiters:
                    waiters.remove((loop, fut))
                    if not waiters:
                        del self._waiters[message]

    # --- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            waiters = [w for ws in self._waiters.values() for w in ws]
            self._waiters.clear()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_fail, fut, RuntimeError(f"transfer agent {self._name!r} closed"))
            except RuntimeError:
                pass
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._pool_tensor = None
        logger.info("%s: closed transfer agent %r", self.BACKEND, self._name)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_FRAME.pack(len(payload)) + payload)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv_frame(conn: socket.socket) -> bytes:
    (n,) = _FRAME.unpack(_recv_exact(conn, _FRAME.size))
    if n > _MAX_FRAME:
        raise EOFError  # not our protocol: drop the connection
    return _recv_exact(conn, n)
