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


@pytest.mark.parametrize("per_launch", [1, 2, 3])
def test_overlap_on_cuda_equals_plain_loop_and_reference(cuda_model, per_launch):
    prompts = [[(31 * i + 7 * j) % 9000 + 1 for j in range(12 + 9 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    over, rt = asyncio.run(generate(cuda_model, 0, prompts, params, decode_steps_per_launch=per_launch))
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


@pytest.mark.parametrize("per_launch", [1, 2, 4])
def test_fast_bf16_overlap_with_graphs_agrees_with_plain_loop(per_launch):
    # The worker's GPU path end to end: bf16 weights (fast mode: graphs captured by the runtime,
    # device-resident block tables, placeholders resolved inside the graph) with the overlap loop
    # against the plain loop. Batches form in a different order in the two loops and bf16 GEMMs
    # round differently per batch size, so the check is agreement, not identity: a broken
    # placeholder or table would give unrelated tokens. Two steps per launch replay graphs back
    # to back: the second step's inputs go into the same static buffers behind the first replay.
    from engine.model_source import TINY, load_model
    loaded = load_model(TINY, dtype=torch.bfloat16)
    loaded.model.to("cuda")
    prompts = [[(17 * i + 3 * j) % 9000 + 1 for j in range(10 + 23 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    over, rt = asyncio.run(generate(loaded, 0, prompts, params, max_running=16, decode_steps_per_launch=per_launch))
    assert rt.runner.fast and rt.runner.graphs is not None
    assert (rt.stats.decode_launches < rt.stats.decode_steps) == (per_launch > 1)
    plain, _ = asyncio.run(generate(loaded, 0, prompts, params, max_running=16, disable_overlap_schedule=True))
    same = sum(a == b for x, y in zip(over, plain) for a, b in zip(x, y))
    total = sum(len(x) for x in over)
    assert all(len(x) == 40 for x in over) and same / total >= 0.8, (same, total)
    assert rt.pool.blocks.num_free == rt.pool.config.num_blocks - 1  # all but the graphs' scratch block
