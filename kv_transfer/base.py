"""KV block transfer interface.

A worker owns one KV pool: one contiguous memory region in which block `b` occupies the bytes
[base + b * stride, base + (b + 1) * stride). With the engine's pool tensor of shape
[num_blocks, num_layers, block_size, kv_dim] the stride is `tensor[0].numel() * element_size`.

The prefill worker P writes blocks of its pool into the decode worker D's pool with one-sided
WRITEs (one per finished prefill chunk, see prefill_worker/chunk_sender.py), the last of them
with a notification carrying the request id; D starts decoding once it has it. Only addresses
cross the wire (`PoolDescriptor` / `RemoteBlocks`), so any layout with a fixed block stride
works, and the pool is treated as bytes (float32, bfloat16 and float8_e4m3fn pools alike).
Backends share these semantics: `nixl` (NIXL/UCX, any hosts), `shm` (host pools in shared
memory on one host), `cuda-ipc` (CUDA pools of processes on one host); `kv_transfer/select.py`
picks one per peer pair.

Units: addresses, strides and sizes in bytes; durations and timeouts in seconds.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, NewType, Sequence

if TYPE_CHECKING:
    import torch

BlockId = NewType("BlockId", int)
"""Index of a block in a KV pool (0 <= id < num_blocks)."""

PeerName = NewType("PeerName", str)
"""Transfer agent name of a worker, as announced in discovery."""

HOST_DEVICE = -1
"""`device_id` of host (CPU) memory; a CUDA device index is >= 0 (torch's `get_device()`)."""


class TransferError(Exception):
    """A transfer could not be started or did not complete (unknown peer, bad remote memory,
    peer disconnected, backend error). The in-flight handle has been released."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer or a notification did not complete within its timeout."""


class PoolDescriptor(NamedTuple):
    """Where a registered pool lives; sent to peers so they can address its blocks.

    base_address: address of block 0 (bytes). block_stride_bytes: bytes per block, and the
    distance between consecutive blocks. device_id: HOST_DEVICE (-1) or a CUDA device index.
    num_blocks: blocks in the pool.
    """

    base_address: int
    block_stride_bytes: int
    device_id: int
    num_blocks: int

    def blocks(self, block_ids: Sequence[int]) -> RemoteBlocks:
        """The `RemoteBlocks` naming `block_ids` of this pool (ids are checked: ValueError)."""
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        return RemoteBlocks(self.base_address, self.block_stride_bytes, self.device_id,
                            tuple(block_ids))


class RemoteBlocks(NamedTuple):
    """Destination blocks in a peer's pool: the peer's `PoolDescriptor` fields plus block ids.

    The peer's backend validates that the addressed bytes lie in memory it registered; the
    sender cannot check the range itself.
    """

    base_address: int
    block_stride_bytes: int
    device_id: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class TransferResult:
    """Outcome of a successful `write_blocks`.

    bytes: payload bytes written. seconds: wall time from submission to completion.
    descriptors: number of (merged) contiguous descriptors the transfer used.
    backend: the backend that moved the bytes ("nixl", "shm", "cuda-ipc").
    """

    bytes: int
    seconds: float
    descriptors: int
    backend: str = ""


def merge_runs(src_ids: Sequence[int], dst_ids: Sequence[int],
               stride: int) -> list[tuple[int, int, int]]:
    """Byte ranges for copying block src_ids[i] to block dst_ids[i], for all i, in order.

    Consecutive pairs where both the source and the destination ids advance by exactly one are
    merged into one range, so a transfer uses few, large descriptors (per-descriptor overhead
    dominates for small blocks).

    Args:
        src_ids: source block ids (>= 0; repeats allowed).
        dst_ids: destination block ids (>= 0, distinct), same length as src_ids.
        stride: bytes per block (> 0), the same in both pools.

    Returns:
        [(src_offset, dst_offset, length)] in bytes, relative to each pool's base address;
        empty for empty input. Lengths sum to len(src_ids) * stride.

    Raises:
        ValueError: lengths differ, a negative id, a repeated destination id (two sources
            would race for one block), or stride <= 0.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    if stride <= 0:
        raise ValueError(f"stride must be > 0 bytes, got {stride}")
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("destination block ids repeat")
    runs: list[tuple[int, int, int]] = []
    run_src = run_dst = run_len = 0  # current run, in blocks
    for s, d in zip(src_ids, dst_ids):
        if s < 0 or d < 0:
            raise ValueError(f"negative block id in ({s}, {d})")
        if run_len and s == run_src + run_len and d == run_dst + run_len:
            run_len += 1
            continue
        if run_len:
            runs.append((run_src * stride, run_dst * stride, run_len * stride))
        run_src, run_dst, run_len = s, d, 1
    if run_len:
        runs.append((run_src * stride, run_dst * stride, run_len * stride))
    return runs


def plan_write(pool: PoolDescriptor | None, src_block_ids: Sequence[int], dst: RemoteBlocks,
               notification: bytes | None, timeout_s: float) -> list[tuple[int, int, int]]:
    """Check `write_blocks` arguments against the local pool; the merged byte runs to copy.

    Returns:
        `merge_runs(src_block_ids, dst.block_ids, stride)`.

    Raises:
        RuntimeError: no pool registered. ValueError: as `KvTransferAgent.write_blocks` says.
    """
    if pool is None:
        raise RuntimeError("register_pool before writing blocks")
    if notification is not None and not notification:
        raise ValueError("notification must be non-empty bytes (or None for a data-only write)")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if dst.block_stride_bytes != pool.block_stride_bytes:
        raise ValueError(f"destination block stride {dst.block_stride_bytes} B != local "
                         f"{pool.block_stride_bytes} B (different KV layouts)")
    for b in src_block_ids:
        if not 0 <= b < pool.num_blocks:
            raise ValueError(f"source block id {b} out of range [0, {pool.num_blocks})")
    return merge_runs(src_block_ids, dst.block_ids, pool.block_stride_bytes)


MAX_NOTIFICATION_TOKEN_BYTES = 64  # PrefillRequest.notification_token


def notification(request_id: str, token: bytes = b"") -> bytes:
    """The message that announces request `request_id`'s KV as written: its id, and after a '#'
    the decode worker's secret for the call in hex (PrefillRequest.notification_token; none
    when empty), so a message from anyone who did not get the call matches no waiter."""
    return request_id.encode() + (b"#" + token.hex().encode() if token else b"")


class KvTransferAgent(abc.ABC):
    """One worker's endpoint for KV block transfers.

    Lifecycle: create -> `register_pool` (once) -> `metadata()` is published (gRPC call or
    discovery record) -> peers call `add_peer` with it -> `write_blocks` / `wait_notification`
    -> `close()`. Peer metadata is cached until `remove_peer` (call it when the peer leaves
    discovery).

    Threading: an agent is driven from one thread (the worker's asyncio event loop); the
    coroutines may run concurrently on that loop.
    """

    @property
    @abc.abstractmethod
    def name(self) -> PeerName:
        """This agent's name (unique among the workers that talk to each other)."""

    @property
    def backend(self) -> str:
        """Backend name ("nixl", "shm", "cuda-ipc"; "auto" for the selecting agent)."""
        return type(self).__name__

    @abc.abstractmethod
    def register_pool(self, tensor: torch.Tensor) -> PoolDescriptor:
        """Register the KV pool: the source of `write_blocks` and the target of peers' writes.

        Args:
            tensor: contiguous, non-empty, first dimension = blocks. The agent keeps a
                reference, so the memory stays valid until `close()`.

        Returns:
            The pool's descriptor (send it to peers with the metadata).

        Raises:
            ValueError: not contiguous or empty. RuntimeError: a pool is already registered,
                or the agent is closed. TransferError: the backend refused the memory.
        """

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to `add_peer` to reach this agent.

        Call after `register_pool`: the metadata describes the registered memory, and a peer
        holding older metadata cannot write into memory registered later.

        Raises:
            RuntimeError: no pool registered yet, or closed.
        """

    @abc.abstractmethod
    def add_peer(self, name: str, metadata: bytes) -> None:
        """Load a peer's metadata so `write_blocks` can target it.

        Idempotent: the same (name, metadata) again is a no-op; new metadata for a known name
        (the peer restarted) replaces the old.

        Raises:
            ValueError: `name` is empty, is this agent's own name, or differs from the name in
                `metadata`. TransferError: the backend rejected the metadata.
        """

    @abc.abstractmethod
    def has_peer(self, name: str) -> bool:
        """Whether metadata for `name` is loaded."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer (it left discovery). Unknown names are ignored. Transfers already in
        flight to it end on their own (success, error or timeout); new ones raise TransferError.
        """

    @abc.abstractmethod
    async def write_blocks(self, peer_name: str, src_block_ids: Sequence[int],
                           dst: RemoteBlocks, notification: bytes | None,
                           timeout_s: float) -> TransferResult:
        """Write local blocks src_block_ids[i] into the peer's blocks dst.block_ids[i], then
        deliver `notification` (the request id) to the peer, after all the data.

        Ordering: the notification reaches the peer after this write's data and after the data
        of every earlier write to the same peer that returned before this one was called, so a
        request sent as several data-only writes (notification None) and one last write with
        the notification is complete at the peer when the notification arrives.

        Exactly one terminal outcome: a `TransferResult`, or an exception; in every case
        (including cancellation of the awaiting task) the in-flight handle is released, which
        aborts an unfinished transfer. With no blocks, only the notification is sent.

        Args:
            peer_name: a name added with `add_peer`.
            src_block_ids: blocks of the local pool.
            dst: the peer's pool (from its `PoolDescriptor`) and destination ids, one per source.
            notification: bytes the peer receives via `wait_notification` (non-empty), or None
                for a data-only write (an intermediate chunk of a request).
            timeout_s: seconds before giving up (> 0).

        Returns:
            TransferResult(bytes, seconds, descriptors, backend).

        Raises:
            ValueError: bad ids (out of the local range, length mismatch, repeated
                destinations), dst.block_stride_bytes != the local stride, empty notification,
                timeout_s <= 0. TransferError: unknown peer (before anything is sent), the
                backend refused the descriptors (e.g. dst outside the peer's registered
                memory), or the transfer failed (peer gone). TransferTimeout: not done within
                timeout_s. RuntimeError: no pool registered, or closed.
        """

    @abc.abstractmethod
    async def wait_notification(self, message: bytes, timeout_s: float) -> PeerName:
        """Wait until a notification equal to `message` arrives from any peer; consume it.

        Notifications with other messages are buffered (bounded) for their own waiters, so
        concurrent requests each get theirs, and a notification that arrives before its waiter
        is not lost.

        Args:
            message: the exact bytes the writer passed as `notification`.
            timeout_s: seconds to wait (> 0).

        Returns:
            The sender's agent name.

        Raises:
            TransferTimeout: nothing matching within timeout_s. RuntimeError: closed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release handles, registrations and peers. Idempotent; the agent is unusable after."""

    def __enter__(self) -> KvTransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
