"""The overlap scheduler's code path on a CPU (decode_worker/overlap.py): inputs resolved from
the future-token map, a finished request's extra in-flight token dropped, deferred block frees.
On a CPU each launch completes at once, but the placeholders, the map and the lagged
post-processing are the same code as on CUDA."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from common.sampling_params import SamplingParams
from decode_helpers import generate
from engine.future_map import FutureTokenMap
from engine.reference import reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_future_map_resolves_placeholders() -> None:
    fmap = FutureTokenMap(4, "cpu")
    slots = fmap.reserve(3)
    fmap.store(torch.tensor(slots), torch.tensor([7, 8, 9]))
    ids = torch.tensor([5, fmap.placeholder(slots[2]), fmap.placeholder(slots[0])])
    assert fmap.resolve(ids).tolist() == [5, 9, 7]
    assert fmap.reserve(2) == [3, 0]  # a ring


def test_overlap_greedy_equals_reference_and_frees_blocks(tiny_model) -> None:
    prompts = [[(13 * i + j) % 9000 for i in range(n)] for j, n in enumerate([5, 16, 33, 9])]
    lens = [12, 2, 7, 20]
    # request 3 ends at an "eos" mid-way: the step already in flight for it must be dropped
    plain3 = reference_generate(tiny_model.model, prompts[3], 20)
    eos = next(t for i, t in enumerate(plain3) if i >= 4 and t not in plain3[:i])
    loaded = dataclasses.replace(
        tiny_model, config=dataclasses.replace(tiny_model.config, eos_token_id=(eos,)))
    params = [SamplingParams(max_tokens=n) for n in lens]
    got, rt = asyncio.run(generate(loaded, 0, prompts, params, overlap=True, cancel=2))
    for i, (prompt, n) in enumerate(zip(prompts, lens)):
        ref = reference_generate(tiny_model.model, prompt, n, {eos})
        assert got[i] == (ref[:3] if i == 2 else ref)
    assert rt.pool.blocks.num_free == rt.opts.num_blocks
    st = rt.stats  # the step cadence counters (tandem_worker_decode_*)
    assert st.decode_steps > 0 and st.decode_step_rows > st.decode_steps  # several requests per step
    assert 0 < st.decode_busy_steps < st.decode_steps and st.decode_step_seconds > 0


def test_overlap_sampling_equals_plain_loop(tiny_model) -> None:
    prompts = [[(29 * i + 1) % 9000 for i in range(20)], [4, 5, 6]]
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=5), SamplingParams(max_tokens=8)]
    plain, _ = asyncio.run(generate(tiny_model, 0, prompts, params))
    over, _ = asyncio.run(generate(tiny_model, 0, prompts, params, overlap=True))
    assert over == plain


@pytest.mark.parametrize("argv,env,want", [
    ([], None, False),
    (["--disable-overlap-schedule"], None, True),
    (["--no-disable-overlap-schedule"], "true", False),
    ([], "true", True),
])
def test_disable_overlap_flag_and_env(monkeypatch, argv, env, want) -> None:
    from cli import config
    from cli.flags import build
    from cli.main import build_parser
    from worker.host import WorkerOptions

    monkeypatch.delenv("TANDEM_DISABLE_OVERLAP_SCHEDULE", raising=False)
    if env is not None:
        monkeypatch.setenv("TANDEM_DISABLE_OVERLAP_SCHEDULE", env)
    parser = build_parser()
    args = parser.parse_args(["decode", *argv])
    config.apply(parser, args)
    assert build(WorkerOptions, args).disable_overlap_schedule is want


def test_bad_boolean_env_names_the_variable(monkeypatch) -> None:
    from cli import config
    from cli.main import build_parser

    monkeypatch.setenv("TANDEM_DISABLE_OVERLAP_SCHEDULE", "maybe")
    parser = build_parser()
    args = parser.parse_args(["decode"])
    with pytest.raises(config.ConfigError, match="TANDEM_DISABLE_OVERLAP_SCHEDULE"):
        config.apply(parser, args)


def test_overlap_retraction_loses_no_in_flight_token(tiny_model) -> None:
    """A request retracted while its next token is in flight (the overlap loop launches step
    i + 1 before it post-processes step i) resumes from its last real token: every stream,
    greedy and seeded, equals the one of a pool large enough for all, no token lost or
    repeated, no block left behind."""
    prompts = [[(31 * i + 7 * j) % 9000 + 1 for i in range(16)] for j in range(4)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in range(3)]
    params.append(SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=3))
    roomy, _ = asyncio.run(generate(tiny_model, 0, prompts, params))
    # 9 blocks of 16 tokens: the four need 16 at full length, so the loop must retract
    tight, rt = asyncio.run(generate(tiny_model, 0, prompts, params, num_blocks=9, overlap=True))
    assert rt.stats.retractions > 0
    assert tight == roomy
    assert roomy[0] == reference_generate(tiny_model.model, prompts[0], 40)
    assert rt.pool.blocks.num_free == 9
