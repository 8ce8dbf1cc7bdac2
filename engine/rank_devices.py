"""Devices and the collective backend of a worker's rank processes (expert-parallel ranks,
decode_worker/ep_ranks.py; pipeline stages, engine/pipeline.py).

From a worker on `cuda:i`, rank r owns GPU i + r (NCCL refuses two ranks on one GPU) and the
ranks talk over NCCL with NVLink multicast off (NCCL_NVLS_ENABLE=0 unless set: the lent
machines' rule); on a CPU every rank is a CPU process and the backend is gloo.
"""

from __future__ import annotations

import os

import torch


def rank_devices(device: torch.device | str, n: int, flag: str) -> list[torch.device]:
    """The n ranks' devices from the worker's (rank 0's) device. On CUDA also turns NVLink
    multicast off for this process and the ranks it spawns. Raises ValueError naming `flag`
    (e.g. "--ep-size") and --device when the machine has too few GPUs."""
    device = torch.device(device)
    if device.type != "cuda":
        return [torch.device("cpu")] * n
    first = device.index if device.index is not None else torch.cuda.current_device()
    have = torch.cuda.device_count()
    if first + n > have:
        raise ValueError(f"{flag} {n} from --device cuda:{first} needs GPUs {first}..{first + n - 1}; "
                         f"this machine has {have}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the rank processes spawned after
    return [torch.device("cuda", first + r) for r in range(n)]


def collective_backend(device: torch.device) -> str:
    """torch.distributed's backend for ranks on `device`: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"
