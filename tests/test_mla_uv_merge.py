"""W_UV inside the MLA decode merge (engine/kernels/mla_decode.py `_mla_stage2_uv`) against the
reference in Triton's interpreter on a CPU (float32: the interpreter's bf16 casts truncate),
and where the decode step takes it (`uv_in_merge`). The bf16 and FP8 kernels and the graph
replay are CUDA tests (tests/test_decode_kernels.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.kernels.mla_decode import mla_decode_reference, uv_in_merge

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1 (the kernels on a CPU through Triton's interpreter)")


def test_the_step_takes_w_uv_in_the_merge_at_a_few_sequences_only() -> None:
    assert uv_in_merge(1, 16) and uv_in_merge(4, 16) and not uv_in_merge(5, 16)  # config M's 16 heads
    assert not uv_in_merge(1, 128)  # a 128-head model's W_UV (16 MB a layer) is read once, by the GEMM


def test_the_reference_rounds_o_lat_and_multiplies_per_head() -> None:
    torch.manual_seed(0)
    heads, rank, rope, v, bs = 2, 16, 8, 4, 4
    kv = torch.randn(6, 1, bs, rank + rope)
    tables = torch.tensor([[1, 2], [3, 4]])
    lens = torch.tensor([5, 8])
    q = torch.randn(2, heads, rank + rope)
    w_uv = torch.randn(heads, v, rank).bfloat16()
    o_lat = mla_decode_reference(q, kv, 0, tables, lens, rank, 0.3)
    got = mla_decode_reference(q, kv, 0, tables, lens, rank, 0.3, w_uv=w_uv)
    assert got.dtype == torch.bfloat16 and got.shape == (2, heads, v) and got.is_contiguous()
    want = torch.stack([o_lat[:, h].bfloat16().float() @ w_uv[h].float().T for h in range(heads)], 1)
    assert torch.equal(got, want.bfloat16())


@interpreter
@pytest.mark.parametrize("v", [40, 128])  # 40: not a multiple of the kernel's BLOCK_V
def test_the_merge_with_w_uv_in_the_interpreter(v: int) -> None:
    from engine.kernels.mla_decode import merge_splits, merge_splits_reference
    torch.manual_seed(v)
    b, heads, splits, rank, nope = 3, 4, 5, 32, 8
    part_o = torch.randn(b, heads, splits, rank)
    part_lse = torch.randn(b, heads, splits) * 3
    part_lse[0, :, 3:] = float("-inf")  # splits past a short context: empty
    part_o[0, :, 3:] = float("nan")  # (never written by stage 1: must not be read)
    w_uv = torch.randn(heads, nope + v, rank).split([nope, v], dim=1)[1]  # strided heads, as the step's view
    o_lat = merge_splits(part_o, part_lse, torch.float32)
    torch.testing.assert_close(o_lat, merge_splits_reference(part_o, part_lse, torch.float32), atol=1e-5, rtol=1e-5)
    got = merge_splits(part_o, part_lse, torch.float32, w_uv)
    assert got.shape == (b, heads, v)
    torch.testing.assert_close(got, merge_splits_reference(part_o, part_lse, torch.float32, w_uv),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, torch.einsum("bhr,hvr->bhv", o_lat, w_uv), atol=1e-4, rtol=1e-4)
