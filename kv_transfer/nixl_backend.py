"""NIXL backend of `KvTransferAgent`: one-sided WRITEs over UCX.

NIXL is imported lazily (`nixl_cu13`, then `nixl`) so the package imports on machines without
it. Facts about the `nixl-cu13` 1.5.1 wheel this module relies on (measured, not documented):

* The UCX progress thread is needed: on one host UCX wires a connection up (and sends
  notifications) with active messages over TCP loopback, and moves the data with CMA
  (process_vm_writev). Without the thread, a WRITE to a target that is not calling into NIXL
  at that moment never completes (measured: hangs); with it, writes are one-sided.
* The Python wrapper hard-codes the progress thread's poll delay to 0, which busy-spins one
  core per agent (100 % CPU while idle). We build the native agent ourselves with
  `progress_delay_us` (default 1000: the thread sleeps on the worker's event fd and wakes at
  least every 1 ms; ~3 % CPU idle, and about twice the bandwidth on 2 cores, where the
  spinning threads competed with the copy).
* On one host UCX writes host memory with CMA (process_vm_writev) *inside* the post call,
  which holds the GIL: a post stalls the whole process for about bytes / 5 GB/s
  (~25 ms for 134 MB on the 2-core machine); running the post in another thread, several
  UCX workers (`num_workers`), READ instead of WRITE, or other UCX_TLS choices do not help
  (docs/bench/transfer.md). So `write_blocks` posts at most 64 MB at a time and yields
  between posts; on one host the `shm` backend is the fast path. Measured there (tools/bench_transfer.py): ~40 % of a
  2-thread memcpy, ~50 % of a 1-thread one, close to raw process_vm_writev (~7 GB/s).
* Agent names must be non-empty; metadata is ~330 bytes plus ~120 per registered region.
  Creating the first agent of a process takes ~0.45 s (UCX init), later ones ~0.03 s; the
  first WRITE to a peer pays ~20 ms of connection setup. Failures also log through glog/UCX
  on stderr (e.g. `createXferReq: metadata for remote agent 'x' not found`).

Threading: the native agent runs with NIXL_THREAD_SYNC_NONE (the wrapper's default without a
listener thread), so all calls must come from one thread: the asyncio loop that drives this
agent. Coroutines on that loop may overlap; Python-level state needs no lock there.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kv_transfer.base import (HOST_DEVICE, KvTransferAgent, PeerName, PoolDescriptor,
                              RemoteBlocks, TransferError, TransferResult, TransferTimeout,
                              plan_write)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_NIXL_MODULES = ("nixl_cu13", "nixl")
# Polling: a few bare yields catch small transfers that finish within microseconds, then
# sleep; asyncio rounds any positive sleep up to the selector's 1 ms resolution anyway.
_SPIN_YIELDS = 8
_POLL_SLEEP_S = 0.001
# A write is posted in groups of at most this many bytes (see write_blocks).
_MAX_POST_BYTES = 64 << 20
# Notifications nobody waits for (e.g. the waiter timed out) are kept at most this many.
_MAX_BUFFERED_NOTIFS = 4096


def _load_nixl() -> tuple[ModuleType, ModuleType]:
    """(api, bindings) modules of the first NIXL build found; ImportError naming both."""
    errors = []
    for pkg in _NIXL_MODULES:
        try:
            return (importlib.import_module(f"{pkg}._api"),
                    importlib.import_module(f"{pkg}._bindings"))
        except ImportError as exc:
            errors.append(f"{pkg}: {exc}")
    raise ImportError("NIXL is not installed (pip install 'tandem-serve[nixl]'); tried "
                      + "; ".join(errors))


def _mem_type(device_id: int) -> str:
    return "DRAM" if device_id == HOST_DEVICE else "VRAM"


def _nixl_dev(device_id: int) -> int:
    # NIXL names host memory device 0.
    return 0 if device_id == HOST_DEVICE else device_id


def _make_native_agent(api: ModuleType, bind: ModuleType, name: str,
                       progress_delay_us: int) -> Any:
    """A `nixl_agent` wrapper with a UCX backend whose progress thread sleeps between polls.

    The wrapper is created without backends (no progress thread, cheap), then given a native
    agent configured like the wrapper's default except for `pthrDelay`, and the UCX backend.
    """
    wrapper = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    try:
        cfg = bind.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.syncMode = bind.NIXL_THREAD_SYNC_NONE
        cfg.pthrDelay = progress_delay_us
        cfg.lthrDelay = 100_000
        cfg.captureTelemetry = False
        wrapper.agent = bind.nixlAgent(name, cfg)
    except AttributeError:  # a NIXL build without these knobs: default (spinning) thread
        logger.warning("NIXL build lacks pthrDelay; its progress thread will busy-spin a core")
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    wrapper.create_backend("UCX", {})
    return wrapper


async def _kernels_done(device_id: int) -> None:
    """NIXL reads GPU memory outside CUDA streams: wait (without blocking the loop) until the
    kernels queued so far on the device's default stream — those that wrote the blocks — ran."""
    import torch
    done = torch.cuda.Event()
    done.record(torch.cuda.default_stream(device_id))
    while not done.query():
        await asyncio.sleep(_POLL_SLEEP_S)


def _split(runs: list[tuple[int, int, int]], limit: int) -> list[list[tuple[int, int, int]]]:
    """Runs cut into groups of at most `limit` bytes (a longer run is cut in pieces)."""
    groups: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for s, d, n in runs:
        off = 0
        while off < n:
            if size >= limit:
                groups.append([])
                size = 0
            k = min(n - off, limit - size)
            groups[-1].append((s + off, d + off, k))
            size += k
            off += k
    return groups


class NixlAgent(KvTransferAgent):
    """`KvTransferAgent` over NIXL/UCX (see the module docstring for quirks and threading).

    Args:
        name: agent name, non-empty and unique among communicating workers.
        progress_delay_us: UCX progress thread wake-up period in microseconds (0 = busy-spin).

    Raises:
        ImportError: NIXL missing. ValueError: empty name. TransferError: NIXL failed to start.
    """

    def __init__(self, name: str, progress_delay_us: int = 1000) -> None:
        if not name:
            raise ValueError("transfer agent name must be non-empty")
        api, self._bind = _load_nixl()
        t0 = time.monotonic()
        try:
            self._agent = _make_native_agent(api, self._bind, name, progress_delay_us)
        except Exception as exc:  # NIXL raises its own exception types, none shared
            raise TransferError(f"cannot create NIXL agent {name!r}: {exc}") from exc
        logger.info("NIXL agent %r ready in %.3f s", name, time.monotonic() - t0)
        self._name = PeerName(name)
        self._closed = False
        self._pool: PoolDescriptor | None = None
        self._pool_tensor: torch.Tensor | None = None  # keeps the registered memory alive
        self._reg_descs: Any = None
        self._peers: dict[str, bytes] = {}  # name -> the metadata loaded for it
        self._in_flight: dict[str, int] = {}  # name -> transfers not yet released
        self._removed_busy: set[str] = set()  # removed while in flight: invalidate when idle
        self._unreleased: list[Any] = []  # handles NIXL refused to release; retried later
        self._notifs: dict[bytes, list[str]] = {}  # message -> senders, unclaimed
        self._notif_count = 0
        self._waiters: dict[bytes, list[asyncio.Future[str]]] = {}
        self._poller: asyncio.Task[None] | None = None

    @property
    def name(self) -> PeerName:
        return self._name

    @property
    def backend(self) -> str:
        return "nixl"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transfer agent {self._name!r} is closed")

    # --- memory and peers -------------------------------------------------------------------

    def register_pool(self, tensor: torch.Tensor) -> PoolDescriptor:
        self._check_open()
        if self._pool is not None:
            raise RuntimeError("a KV pool is already registered with this agent")
        if not tensor.is_contiguous() or tensor.numel() == 0 or tensor.dim() == 0:
            raise ValueError("KV pool must be a contiguous, non-empty tensor with a block dim")
        try:
            self._reg_descs = self._agent.register_memory(tensor)
        except Exception as exc:
            raise TransferError(f"NIXL refused to register the KV pool: {exc}") from exc
        self._pool_tensor = tensor
        self._pool = PoolDescriptor(base_address=tensor.data_ptr(),
                                    block_stride_bytes=tensor[0].numel() * tensor.element_size(),
                                    device_id=tensor.get_device(),
                                    num_blocks=tensor.shape[0])
        logger.info("registered KV pool: %s", self._pool)
        return self._pool

    def metadata(self) -> bytes:
        self._check_open()
        if self._pool is None:
            raise RuntimeError("register_pool before publishing metadata")
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._check_open()
        if not name or name == self._name:
            raise ValueError(f"invalid peer name {name!r} (empty or this agent's own)")
        if self._peers.get(name) == metadata:
            return
        if name in self._peers:  # the peer restarted: drop the stale connection first
            self.remove_peer(name)
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"invalid NIXL metadata for peer {name!r}: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            if loaded not in self._peers:
                self._invalidate(loaded)
            raise ValueError(f"metadata is for agent {loaded!r}, not {name!r}")
        self._removed_busy.discard(name)
        self._peers[name] = metadata
        logger.info("added transfer peer %r (%d bytes of metadata)", name, len(metadata))

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def remove_peer(self, name: str) -> None:
        if self._closed or self._peers.pop(name, None) is None:
            return
        # Invalidating disconnects; doing it under an in-flight transfer is left to the last
        # transfer's release so that handle is torn down first.
        if self._in_flight.get(name):
            self._removed_busy.add(name)
        else:
            self._invalidate(name)
        logger.info("removed transfer peer %r", name)

    def _invalidate(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            logger.warning("NIXL could not invalidate peer %r", name, exc_info=True)

    # --- writing ------------------------------------------------------------------------------

    def _descs(self, base: int, offsets: np.ndarray, lengths: np.ndarray, device_id: int) -> Any:
        rows = np.empty((len(offsets), 3), dtype=np.uint64)
        rows[:, 0] = base + offsets
        rows[:, 1] = lengths
        rows[:, 2] = _nixl_dev(device_id)
        return self._agent.get_xfer_descs(rows, _mem_type(device_id))

    async def write_blocks(self, peer_name: str, src_block_ids: Sequence[int],
                           dst: RemoteBlocks, notification: bytes | None,
                           timeout_s: float) -> TransferResult:
        self._check_open()
        pool = self._pool
        runs = plan_write(pool, src_block_ids, dst, notification, timeout_s)
        assert pool is not None
        if peer_name not in self._peers:
            raise TransferError(f"unknown transfer peer {peer_name!r} (no metadata loaded)")
        t0 = time.monotonic()
        if not runs:  # D already holds every block: it still needs the go-ahead
            if notification is None:
                return TransferResult(0, 0.0, 0, "nixl")
            try:
                self._agent.send_notif(peer_name, notification)
            except Exception as exc:
                raise TransferError(f"notification to {peer_name!r} failed: {exc}") from exc
            return TransferResult(0, time.monotonic() - t0, 0, "nixl")

        if pool.device_id != HOST_DEVICE:
            await _kernels_done(pool.device_id)
        groups = _split(runs, _MAX_POST_BYTES)
        handles: list[Any] = []
        self._in_flight[peer_name] = self._in_flight.get(peer_name, 0) + 1
        try:
            for i, group in enumerate(groups):
                arr = np.asarray(group, dtype=np.uint64)
                last = i == len(groups) - 1
                try:
                    handles.append(self._agent.initialize_xfer(
                        "WRITE",
                        self._descs(pool.base_address, arr[:, 0], arr[:, 2], pool.device_id),
                        self._descs(dst.base_address, arr[:, 1], arr[:, 2], dst.device_id),
                        peer_name, (notification or b"") if last else b""))  # empty: no notification
                except Exception as exc:  # e.g. NOT_FOUND: dst outside the peer's registered memory
                    raise TransferError(f"cannot create WRITE to {peer_name!r}: {exc}") from exc
            deadline = t0 + timeout_s
            # Every group but the last is posted as its own task: on one host UCX copies inside
            # the post (holding the GIL), so other requests' writes and RPCs run between groups;
            # across hosts the posts pipeline. The last group, with the notification, goes once
            # all others are done, so the notification follows every byte.
            if len(handles) > 1:
                await asyncio.gather(*(self._drive(h, peer_name, deadline, timeout_s) for h in handles[:-1]))
            await self._drive(handles[-1], peer_name, deadline, timeout_s)
        finally:  # success, error, timeout or cancellation: never leak a handle
            for h in handles:
                self._release_one(h, peer_name)
            self._done_with(peer_name)
        total = sum(length for _, _, length in runs)
        seconds = time.monotonic() - t0
        logger.debug("wrote %d B in %d descriptors (%d posts) to %r in %.6f s", total, len(runs),
                     len(groups), peer_name, seconds)
        return TransferResult(total, seconds, len(runs), "nixl")

    async def _drive(self, handle: Any, peer_name: str, deadline: float,
                     timeout_s: float) -> None:
        """Post `handle` and poll it until DONE; TransferError on ERR, TransferTimeout late."""
        try:
            state = self._agent.transfer(handle)
            polls = 0
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"WRITE to {peer_name!r} not done in {timeout_s} s")
                await asyncio.sleep(0 if polls < _SPIN_YIELDS else _POLL_SLEEP_S)
                polls += 1
                state = self._agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError
            raise TransferError(f"WRITE to {peer_name!r} failed: {exc}") from exc
        if state != "DONE":
            raise TransferError(f"WRITE to {peer_name!r} failed (state {state})")

    def _release_one(self, handle: Any, peer_name: str) -> None:
        # Release aborts an unfinished transfer; NIXL may refuse while UCX still owns it, then
        # we keep the handle (its memory must stay registered) and retry on later calls.
        for h in [handle, *self._unreleased]:
            try:
                self._agent.release_xfer_handle(h)
            except Exception:
                if h is handle:
                    logger.warning("NIXL refused to release a WRITE to %r; retrying later",
                                   peer_name, exc_info=True)
                    self._unreleased.append(h)
            else:
                if h is not handle:
                    self._unreleased.remove(h)

    def _done_with(self, peer_name: str) -> None:
        left = self._in_flight[peer_name] - 1
        if left:
            self._in_flight[peer_name] = left
            return
        del self._in_flight[peer_name]
        if peer_name in self._removed_busy:
            self._removed_busy.discard(peer_name)
            self._invalidate(peer_name)

    # --- notifications ------------------------------------------------------------------------

    def _poll_notifs(self) -> int:
        """Move new notifications to waiters (oldest waiter first) or the buffer; count them."""
        new = self._agent.get_new_notifs()
        n = 0
        for sender, messages in new.items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            for msg in messages:
                n += 1
                msg = bytes(msg)
                for fut in self._waiters.get(msg, ()):
                    if not fut.done():
                        fut.set_result(sender)
                        break
                else:
                    self._notifs.setdefault(msg, []).append(sender)
                    self._notif_count += 1
        while self._notif_count > _MAX_BUFFERED_NOTIFS:  # dicts keep insertion order
            oldest = next(iter(self._notifs))
            logger.warning("dropping unclaimed transfer notification %r", oldest)
            senders = self._notifs[oldest]
            senders.pop(0)
            if not senders:
                del self._notifs[oldest]
            self._notif_count -= 1
        return n

    def _take_buffered(self, message: bytes) -> str | None:
        senders = self._notifs.get(message)
        if not senders:
            return None
        sender = senders.pop(0)
        if not senders:
            del self._notifs[message]
        self._notif_count -= 1
        return sender

    async def _poll_loop(self) -> None:
        # One poller per agent however many waiters: its cost does not grow with concurrency.
        idle = 0
        while self._waiters and not self._closed:
            idle = 0 if self._poll_notifs() else idle + 1
            await asyncio.sleep(0 if idle < _SPIN_YIELDS else _POLL_SLEEP_S)

    async def wait_notification(self, message: bytes, timeout_s: float) -> PeerName:
        self._check_open()
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        message = bytes(message)
        self._poll_notifs()
        sender = self._take_buffered(message)
        if sender is not None:
            return PeerName(sender)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        self._waiters.setdefault(message, []).append(fut)
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            self._poller = loop.create_task(self._poll_loop(), name=f"nixl-notifs-{self._name}")
        try:
            return PeerName(await asyncio.wait_for(fut, timeout_s))
        except TimeoutError:
            raise TransferTimeout(
                f"no notification {message!r} within {timeout_s} s") from None
        finally:
            waiters = self._waiters[message]
            waiters.remove(fut)
            if not waiters:
                del self._waiters[message]

    # --- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for futs in self._waiters.values():
            for fut in futs:
                if not fut.done() and not fut.get_loop().is_closed():
                    fut.set_exception(RuntimeError(f"transfer agent {self._name!r} closed"))
        stuck = sum(self._in_flight.values())  # writes still awaited on the loop
        for h in self._unreleased:
            try:
                self._agent.release_xfer_handle(h)
            except Exception:
                stuck += 1
                logger.error("NIXL WRITE handle still unreleased at close", exc_info=True)
        self._unreleased.clear()
        for name in [*self._peers, *self._removed_busy]:
            self._invalidate(name)
        self._peers.clear()
        # Deregistering under a live transfer lets UCX touch unmapped memory: leave it then.
        if self._reg_descs is not None and not stuck:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except Exception:
                logger.warning("NIXL could not deregister the KV pool", exc_info=True)
        self._reg_descs = self._pool_tensor = None
        self._agent = None  # the native agent's destructor stops its progress thread
        logger.info("closed transfer agent %r", self._name)
