"""KV block transfer between workers' KV pools (DESIGN.md section 5).

`create_agent(backend, name)` returns a `KvTransferAgent`; backends are imported lazily so this
package imports on machines without NIXL.
"""

from __future__ import annotations

from kv_transfer.base import (HOST_DEVICE, BlockId, KvTransferAgent, PeerName, PoolDescriptor,
                              RemoteBlocks, TransferError, TransferResult, TransferTimeout,
                              merge_runs)

BACKENDS = ("nixl",)

__all__ = ["BACKENDS", "HOST_DEVICE", "BlockId", "KvTransferAgent", "PeerName", "PoolDescriptor",
           "RemoteBlocks", "TransferError", "TransferResult", "TransferTimeout", "create_agent",
           "merge_runs"]


def create_agent(backend: str, name: str) -> KvTransferAgent:
    """A transfer agent of `backend` named `name` (unique among communicating workers).

    Raises:
        ValueError: unknown backend (the `--transfer-backend` flag) or empty name.
        ImportError: the backend's library is not installed.
        TransferError: the backend failed to start.
    """
    if backend == "nixl":
        from kv_transfer.nixl_backend import NixlAgent
        return NixlAgent(name)
    raise ValueError(f"unknown --transfer-backend {backend!r}; choose one of: "
                     + ", ".join(BACKENDS))
