"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

On Hopper and later, a kernel launched with the programmatic-serialization attribute may start
while the kernel before it in the stream is still running. Each of our kernels so launched
first waits (`griddepcontrol.wait`: until the previous kernel has finished and its writes are
visible) and then lets the next one launch (`griddepcontrol.launch_dependents`), before any load
or store of its own. The next kernel's launch and scheduling then overlap this one's run, where
an ordinary launch starts only after it. A CUDA graph captured with such launches keeps them as
programmatic edges.

Measured on an H100 (tools/bench_pdl.py, a chain of 300 GEMVs in one CUDA graph, Triton 3.6):
0.46 µs less a kernel at 128 KB of weights each (2.00 -> 1.54 µs), 0.68 µs at 2 MB (3.12 ->
2.44), 0.52 µs at 8 MB (5.33 -> 4.80); outputs equal bit for bit. Config M's decode step at
batch 1 (about 265 launches of these kernels) took 2.74 -> 2.67 ms (docs/benchmarks.md, run 25).

Why waiting first is safe: every kernel so launched waits before it touches memory, so it reads
nothing its predecessor has not finished writing and writes nothing its predecessor may still
read; the predecessor itself could not finish before its own predecessor did. One exception,
by design: the decode step's GEMV (engine/kernels/small_gemv.py) loads its weight tile before
the wait, since no kernel of a decode or MTP step writes a weight (its call sites pass
load-time parameters only). Kernels that are
not ours (cuBLAS, inductor's) launch as before and wait for the whole previous kernel.

Used only inside `dependent_launches` (the decode and MTP graphs' capture and the warm-up just
before it, where grids are one wave or a few: a kernel of many waves that lets the next launch
early would share its SMs with the next kernel's waiting programs), and only where `supported`:
an NVIDIA GPU of compute capability 9.0 or later, a Triton with PDL (3.4 and later), not its
interpreter, and TANDEM_PDL not 0 (`TANDEM_PDL=0` turns it off, for an A/B or a driver that
mishandles it). A kernel compiled with PDL is a separate variant in Triton's cache: the graphs'
warm-up runs once with plain launches too, so that eager steps and the sampling after a replay
find theirs compiled (engine/graph_runner.py, engine/spec_graphs.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

try:  # the GPU machine has triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

_ON = threading.local()


@functools.cache
def _triton_has_pdl() -> bool:
    """Whether the installed Triton launches with PDL: `launch_pdl` among its CUDA compile options
    and `tl.extra.cuda.gdc_wait` (Triton 3.4 and later; torch 2.6's Triton 3.2 has neither, and
    passing the option there raises at the launch)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents"))


def _interpreting() -> bool:
    # Triton's own reading of TRITON_INTERPRET: 1, true, on, yes
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def supported(device: torch.device | str | None) -> bool:
    """Whether kernels launched on `device` may use PDL: an NVIDIA GPU (not ROCm, whose torch
    also reports capabilities of 9) of compute capability 9.0 or later, a Triton that has it,
    not its interpreter, and TANDEM_PDL not 0."""
    if triton is None or os.environ.get("TANDEM_PDL", "1") == "0" or _interpreting():
        return False
    d = torch.device(device) if device is not None else None
    if d is None or d.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(d)[0] >= 9 and _triton_has_pdl()


@contextlib.contextmanager
def dependent_launches(device: torch.device | str | None):
    """Within this, on this thread, our Triton kernels launch with PDL where `supported(device)`.
    Nests; other threads are unaffected (a worker's second model thread, a prefill stream)."""
    before = getattr(_ON, "on", False)
    _ON.on = supported(device)
    try:
        yield
    finally:
        _ON.on = before


def active() -> bool:
    """Whether this thread is inside `dependent_launches` on a device that supports PDL."""
    return getattr(_ON, "on", False)


def flags() -> dict:
    """Keyword arguments of a kernel launch: the kernel's `PDL` constexpr, and the launch option
    where it is on (the option is left out otherwise: Triton's interpreter does not take it)."""
    return {"PDL": True, "launch_pdl": True} if active() else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_then_release():
        """A kernel's first statement under PDL (constexpr PDL true): wait for the previous
        kernel's writes, then let the next kernel launch."""
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
