"""KV block transfer between workers' KV pools (docs/architecture.md, step 4).

`create_agent(backend, name)` returns a `KvTransferAgent` that chooses a backend per peer pair
(`select.py`): `cuda-ipc` (CUDA pools on one host), `shm` (host pools on one host) or `nixl`
(anything else). Backends are imported lazily, so this package imports on machines without
NIXL and without CUDA.
"""

from __future__ import annotations

from kv_transfer.base import (HOST_DEVICE, BlockId, KvTransferAgent, PeerName, PoolDescriptor,
                              RemoteBlocks, TransferError, TransferResult, TransferTimeout,
                              merge_runs)
from kv_transfer.select import BACKENDS, CHOICES, SelectingAgent, prepare_pool

__all__ = ["BACKENDS", "CHOICES", "HOST_DEVICE", "BlockId", "KvTransferAgent", "PeerName",
           "PoolDescriptor", "RemoteBlocks", "SelectingAgent", "TransferError", "TransferResult",
           "TransferTimeout", "create_agent", "merge_runs", "prepare_pool"]


def create_agent(backend: str, name: str) -> SelectingAgent:
    """A transfer agent named `name` (unique among communicating workers) using `backend`:
    "auto" (choose per peer from every backend available here) or one of `BACKENDS`.

    Raises:
        ValueError: unknown backend (the `--transfer-backend` flag) or empty name.
        ImportError: the named backend's library is not installed.
        TransferError: the named backend (or, for "auto", every backend) failed to start.
    """
    return SelectingAgent(backend, name)
