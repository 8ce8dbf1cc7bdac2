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


class PinnedRing:
    """Per-step host-to-device copies of small integer tables through reused pinned buffers.

    `upload` pins a fresh staging tensor per call: on a decode step's host path (two calls per
    step, every step) building the tensor from Python lists and taking a pinned block cost about
    0.1 ms each on an H200 host under the worker's load (py-spy of the served decode worker).
    Here the rows are written straight into the numpy view of one of `depth` pinned buffers
    (grown as needed, never shrunk), copied without blocking, and an event after the copy tells
    when that buffer may be written again: a buffer is reused `depth` calls later, long after
    its copy ran (the decode loop has at most two launches of a few steps in flight, and the
    block tables' ring is deep enough for them), so the wait is a formality
    that only a stalled device would make real. Off CUDA the same staging runs in plain
    buffers and the result is a copy of the buffer (nothing to wait for).

    Args:
        device: where the tensors go.
        depth: buffers in the ring.
    """

    def __init__(self, device: torch.device, depth: int = 8) -> None:
        self.device = device = torch.device(device)
        self.cuda = device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * depth
        self._done: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0

    def upload(self, rows: list[list[int]], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """rows (equal-length lists of ints) as a [len(rows), len(rows[0])] tensor of dtype on
        the device, copied without waiting for the device; into `out` (a tensor of that shape and
        dtype on the device, e.g. a CUDA graph's static input) when given, and returned.

        Raises:
            ValueError: rows of different lengths (numpy cannot make a table of them), or an
                `out` of another shape or dtype.
        """
        if dtype not in _NUMPY_INT:
            raise ValueError(f"PinnedRing stages integer tables (int32, int64), not {dtype}")
        try:
            table = np.asarray(rows, dtype=_NUMPY_INT[dtype])
        except ValueError as exc:  # ragged rows
            raise ValueError(f"rows must be equal-length lists of ints: {exc}") from None
        if table.ndim != 2:
            raise ValueError(f"rows must be equal-length lists of ints, got an array of shape {table.shape}")
        if out is not None and (tuple(out.shape) != table.shape or out.dtype != dtype):
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, the table {table.shape} {dtype}")
        i, nbytes = self._next, table.nbytes
        self._next = (i + 1) % len(self._bufs)
        if self._done[i] is not None:
            self._done[i].synchronize()  # its last copy ran long ago (see the class docstring)
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[i] = torch.empty(max(nbytes, 8192), dtype=torch.uint8, pin_memory=self.cuda)
        host = buf[:nbytes].view(dtype).view(table.shape)
        host.numpy()[...] = table
        if out is None:  # (off CUDA a copy too: a result is never the ring's own memory)
            out = torch.empty(table.shape, dtype=dtype, device=self.device)
        out.copy_(host, non_blocking=self.cuda)
        if self.cuda:
            if self._done[i] is None:
                self._done[i] = torch.cuda.Event()  # made once, recorded again at each use of its buffer
            self._done[i].record()
        return out


_NUMPY_INT = {torch.int64: np.int64, torch.int32: np.int32}
