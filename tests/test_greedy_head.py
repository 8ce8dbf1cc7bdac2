"""The greedy head on GPUs (engine/kernels/greedy_head.py) against its torch twin: the same
tokens (ties to the lowest id, across chunks too; a NaN row's NaN), the log-probability within
float32 summation order. On CUDA, and with TRITON_INTERPRET=1 (triton installed) on a CPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.kernels.greedy_head import CHUNK, greedy_head, greedy_reference
from engine.sampling import greedy_batch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the lent H200)")
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1 (the kernels on a CPU through Triton's interpreter)")


def _check(device: str, dtype: torch.dtype, shapes) -> None:
    g = torch.Generator().manual_seed(0)
    for b, v in shapes:
        x = (torch.randn(b, v, generator=g) * 4).to(dtype).to(device)
        if v > 2 * CHUNK:  # row 0: its max twice, in two chunks: the lower id wins
            x[0, 7] = x[0].max() + 1
            x[0, v - 3] = x[0, 7]
        tokens, logprobs = greedy_head(x)
        want_tokens, want_logprobs = greedy_reference(x)
        assert torch.equal(tokens, want_tokens), (b, v)
        assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
        torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=2e-5)
    x = torch.randn(2, 5000, generator=g).to(device)
    x[1, 4000] = float("nan")
    tokens, logprobs = greedy_head(x)
    assert tokens.tolist() == greedy_reference(x)[0].tolist() and tokens[1] == 4000 and logprobs[1].isnan()
    strided = torch.randn(3, 2 * 3000, generator=g).to(device)[:, ::2]
    assert torch.equal(greedy_head(strided)[0], greedy_reference(strided)[0])


def test_greedy_batch_runs_the_twin_on_a_cpu() -> None:
    x = torch.randn(3, 50)
    assert all(torch.equal(a, b) for a, b in zip(greedy_batch(x), greedy_reference(x)))


@interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf - inf in the NaN row (NaN, as meant)
def test_kernels_in_the_interpreter() -> None:
    _check("cpu", torch.float32, [(1, 102400), (3, 5000), (2, CHUNK), (2, CHUNK + 1), (4, 1)])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_cuda(dtype) -> None:
    _check("cuda", dtype, [(1, 102400), (64, 102400), (8, 32000), (2, CHUNK + 1), (4, 1)])


@cuda
def test_greedy_batch_in_a_cuda_graph_gives_the_eager_bits() -> None:
    x = torch.randn(64, 102400, device="cuda")
    eager = greedy_batch(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = greedy_batch(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1])
