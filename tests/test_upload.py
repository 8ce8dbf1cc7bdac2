"""engine/upload.py: host tables to the device without a stream synchronize, through fresh
pinned tensors (`upload`) or a ring of reused pinned buffers (`PinnedRing`, a decode step's
host path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.upload import PinnedRing


def _tables(n: int) -> list[tuple[list[list[int]], torch.dtype]]:
    # tables of changing shapes (some larger than the first buffers) and both dtypes
    rng = np.random.default_rng(5)
    return [(rng.integers(-(2**31), 2**31 - 1, size=(1 + i % 5, 1 + (7 * i) % 300 + (2000 if i == 7 else 0))).tolist(),
             torch.int32 if i % 2 else torch.int64) for i in range(n)]


def test_ring_stages_every_table_and_reuses_its_buffers_on_cpu() -> None:
    ring = PinnedRing(torch.device("cpu"), depth=3)
    got = [(rows, dtype, ring.upload(rows, dtype)) for rows, dtype in _tables(12)]
    for rows, dtype, t in got:  # each result its own copy: later calls rewrote the buffers
        assert t.dtype == dtype and t.tolist() == rows
    bufs = [b.data_ptr() for b in ring._bufs]
    ring.upload([[1, 2]], torch.int64)
    assert [b.data_ptr() for b in ring._bufs] == bufs  # reused, not reallocated
    with pytest.raises(ValueError, match="equal-length"):
        ring.upload([[1, 2], [3]], torch.int64)
    with pytest.raises(ValueError, match="equal-length"):
        ring.upload([1, 2], torch.int64)
    with pytest.raises(ValueError, match="integer tables"):
        ring.upload([[1.5]], torch.float32)
    # into a given tensor (a graph's static input): that tensor, filled; another shape refused
    static = torch.full((5, 8), -7, dtype=torch.int64)
    view = static[:, :3]
    assert ring.upload([[1, 2, 3]] * 5, torch.int64, out=view) is view
    assert static[:, :3].tolist() == [[1, 2, 3]] * 5 and static[:, 3:].eq(-7).all()
    with pytest.raises(ValueError, match=r"out is \(5, 3\)"):
        ring.upload([[1, 2]] * 5, torch.int64, out=view)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned buffers and events (run on the lent H200)")
def test_ring_on_cuda_waits_for_pending_copies_before_reusing_a_buffer() -> None:
    # the device is held busy first, so every copy is still pending when the ring comes round
    # to its buffer again: without the event wait the host would rewrite a buffer under a
    # queued copy and an earlier result would show a later call's values
    dev = torch.device("cuda")
    ring = PinnedRing(dev, depth=3)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time queued ahead of the copies
    got = [(rows, dtype, ring.upload(rows, dtype)) for rows, dtype in _tables(12)]
    torch.cuda.synchronize()
    for rows, dtype, t in got:
        assert t.device.type == "cuda" and t.dtype == dtype and t.tolist() == rows
    assert all(b.is_pinned() for b in ring._bufs)
    bufs = [b.data_ptr() for b in ring._bufs]
    ring.upload([[1, 2]], torch.int64)
    torch.cuda.synchronize()
    assert [b.data_ptr() for b in ring._bufs] == bufs
    # into a strided slice of a device tensor (a copy through a temporary), behind queued work
    static = torch.full((5, 16), -7, dtype=torch.int64, device=dev)
    torch.cuda._sleep(50_000_000)
    ring.upload([[i, i + 1, i + 2] for i in range(5)], torch.int64, out=static[:, :3])
    torch.cuda.synchronize()
    assert static[:, :3].tolist() == [[i, i + 1, i + 2] for i in range(5)] and static[:, 3:].eq(-7).all()
