"""Our model against transformers' own DeepseekV3 implementation: a checkpoint written by
transformers (`save_pretrained`, safetensors) loads with engine/loader.py and gives the same
logits for the same prompt.

Skipped where transformers is not installed (it is a `dev` extra; the GPU machine has it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache_contiguous import ContiguousKvCache
from engine.loader import load_checkpoint
from engine.reference import reference_generate

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'tandem[dev]'); this check runs where it is, e.g. on the GPU machine")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 99, 1023, 7, 7, 300, 2047, 12, 64, 1500, 3, 800]


def hf_model(tmp_path: Path, config: ModelConfig, seed: int = 0):
    """A transformers DeepseekV3ForCausalLM with its own random init, saved to tmp_path."""
    d = config.to_hf_dict()
    for key in ("architectures", "model_type"):
        d.pop(key)
    hf_config = transformers.DeepseekV3Config(**d)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():  # HF inits the bias to zeros; a non-zero bias checks it is loaded and used
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(0.0, 0.05)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    # tiny, with a small vocabulary; transformers keeps no MTP module
    return dataclasses.replace(ModelConfig.tiny(), vocab_size=2048, bos_token_id=1, eos_token_id=(2,),
                               num_nextn_predict_layers=0)


def test_transformers_checkpoint_logits_match(tmp_path: Path, config: ModelConfig) -> None:
    ref = hf_model(tmp_path, config)
    ours, cfg = load_checkpoint(tmp_path)
    assert cfg.num_nextn_predict_layers == 0 and cfg.vocab_size == config.vocab_size
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        want = ref(input_ids=ids[None]).logits[0].float()  # [T, vocab]
        hidden = ours(ids, torch.arange(len(PROMPT)), [len(PROMPT)], ContiguousKvCache(cfg.num_kv_layers))
        got = ours.logits(hidden)
    assert want.std() > 1e-2  # a real signal, not a degenerate init
    # float32; the tolerance covers summation order (HF loops experts differently)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # and greedy continuations agree with transformers' generate
    with torch.inference_mode():
        hf_out = ref.generate(ids[None], max_new_tokens=8, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, len(PROMPT):].tolist()
    assert reference_generate(ours, PROMPT, 8) == hf_out
