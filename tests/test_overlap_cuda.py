"""The overlap scheduler inside a decode worker runtime on a GPU (it runs on CUDA only):
greedy tokens equal the plain loop's and `reference_generate`'s on the same model and device."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.reference import reference_generate
from tests.decode_helpers import generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: the overlap scheduler runs on CUDA only (run on the lent H200)")


@pytest.fixture(scope="module")
def cuda_model():
    from engine.model_source import TINY, load_model
    loaded = load_model(TINY)  # float32
    loaded.model.to("cuda")
    return loaded


def test_overlap_on_cuda_equals_plain_loop_and_reference(cuda_model):
    prompts = [[(31 * i + 7 * j) % 9000 + 1 for j in range(12 + 9 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    over, rt = asyncio.run(generate(cuda_model, 0, prompts, params))
    assert rt.pool.kv.device.type == "cuda"
    plain, _ = asyncio.run(generate(cuda_model, 0, prompts, params, disable_overlap_schedule=True))
    assert over == plain
    for prompt, got in zip(prompts, over):
        assert got == reference_generate(cuda_model.model, prompt, 24)
    assert rt.pool.blocks.num_free == rt.pool.config.num_blocks  # no block still referenced


def test_overlap_on_cuda_sampled_equals_plain_loop(cuda_model):
    prompts = [[(13 * i + 5 * j) % 9000 + 1 for j in range(20)] for i in range(4)]
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=11 + i, ignore_eos=True) for i in range(4)]
    over, _ = asyncio.run(generate(cuda_model, 0, prompts, params))
    plain, _ = asyncio.run(generate(cuda_model, 0, prompts, params, disable_overlap_schedule=True))
    assert over == plain
