"""engine/upload.py: host tables to the device without a stream synchronize, through fresh
pinned tensors (`upload`) or a ring of reused pinned buffers (`PinnedRing`, a decode step's
host path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.upload import PinnedRing, upload


def test_ring_off_cuda_is_upload() -> None:
    ring = PinnedRing(torch.device("cpu"))
    rows = [[1, 2, 3], [4, 5, 6]]
    for dtype in (torch.int32, torch.int64):
        got = ring.upload(rows, dtype)
        assert got.dtype == dtype and got.tolist() == rows
        assert torch.equal(got, upload(rows, dtype, torch.device("cpu")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned buffers and events (run on the lent H200)")
def test_ring_on_cuda_reuses_buffers_and_never_mixes_tables() -> None:
    # more uploads than buffers, tables of changing shapes and both dtypes, no synchronize
    # between them: every result must still hold its own table (a buffer rewritten before its
    # copy ran would show another call's values), and the ring must not grow per call
    dev = torch.device("cuda")
    ring = PinnedRing(dev, depth=3)
    rng = np.random.default_rng(5)
    want, got = [], []
    for i in range(40):
        rows = rng.integers(-(2**31), 2**31 - 1, size=(1 + i % 5, 1 + (7 * i) % 300)).tolist()
        dtype = torch.int32 if i % 2 else torch.int64
        want.append((rows, dtype))
        got.append(ring.upload(rows, dtype))
    torch.cuda.synchronize()
    for (rows, dtype), t in zip(want, got):
        assert t.device.type == "cuda" and t.dtype == dtype and t.tolist() == rows
    assert sum(b is not None for b in ring._bufs) == 3
    with pytest.raises(ValueError, match="equal-length"):
        ring.upload([[1, 2], [3]], torch.int64)
    with pytest.raises(ValueError, match="integer tables"):
        ring.upload([[1.5]], torch.float32)
