"""Host values to a device tensor without a stream synchronize.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch follows such a
copy with a stream synchronize: the host waits until every kernel queued so far has run, so it
cannot queue the next ones meanwhile (a prefill forward had one such wait per sequence). A
pinned staging tensor and a non-blocking copy avoid it: the copy is ordered on the current
stream behind the queued work, and PyTorch's caching host allocator keeps the pinned block
until the copy has run. On a CPU it is a plain tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def upload(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype)` on `device` (data: a list or a numpy array), copied
    without waiting for the device."""
    if isinstance(data, np.ndarray):  # torch.tensor cannot pin what it builds from an array
        host = torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
        if device.type != "cuda":
            return host.to(device, copy=True)  # a copy, as from a list: never the caller's memory
        return host.pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
