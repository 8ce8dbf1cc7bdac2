"""Fast CPU tests of engine.config / model / kv_cache_contiguous / loader / reference."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.kv_cache_contiguous import ContiguousKvCache
from engine.loader import load_checkpoint, save_checkpoint
from engine.model import DeepseekV3ForCausalLM, build_model, route
from engine.reference import reference_generate

VOCAB = 512
PROMPT = [(7 * i + 3) % VOCAB for i in range(23)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return dataclasses.replace(ModelConfig.tiny(), vocab_size=VOCAB, bos_token_id=1,
                               eos_token_id=[2, 3])


@pytest.fixture(scope="module")
def model(config: ModelConfig) -> DeepseekV3ForCausalLM:
    return build_model(config, seed=0)


class BatchKvCache:
    """KvCache of a batch: one ContiguousKvCache per sequence; set q_lens before each step."""

    def __init__(self, n: int, num_layers: int) -> None:
        self.caches = [ContiguousKvCache(num_layers) for _ in range(n)]
        self.q_lens: list[int] = []

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        parts = latent.split(self.q_lens)
        return [c.update(layer, p)[0] for c, p in zip(self.caches, parts, strict=True)]


def _forward(model, ids: list[int], start: int, kv) -> torch.Tensor:
    """Logits [len(ids), vocab] of one sequence's tokens at positions start.. ."""
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), [len(ids)], kv)
        return model.logits(hidden)


# ---- config -------------------------------------------------------------------------------------

def test_config_tiny_and_derived_values() -> None:
    c = ModelConfig.tiny()
    assert c.vocab_size == 151646 and c.eos_token_id == (151643, 151645)
    assert c.qk_head_dim == 24 and c.kv_dim == 40 and c.num_kv_layers == 5
    assert c.eos_token_ids == frozenset({151643, 151645})
    assert c.kv_bytes_per_token(2) == 40 * 5 * 2


def test_config_hf_dict_roundtrip(tmp_path: Path, config: ModelConfig) -> None:
    d = config.to_hf_dict()
    assert d["architectures"] == ["DeepseekV3ForCausalLM"] and d["model_type"] == "deepseek_v3"
    assert d["eos_token_id"] == [2, 3]
    d["torch_dtype"] = "bfloat16"  # unknown keys are ignored
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_json_file(tmp_path / "config.json") == config


@pytest.mark.parametrize("field,value", [("hidden_size", 0), ("qk_rope_head_dim", 7),
                                         ("n_group", 3), ("topk_group", 3),
                                         ("eos_token_id", [VOCAB]), ("q_lora_rank", -1),
                                         ("first_k_dense_replace", 5)])
def test_config_validate_names_field(config: ModelConfig, field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(config, **{field: value})


@pytest.mark.parametrize("key,value", [("rope_scaling", {"type": "yarn", "factor": 40}),
                                       ("hidden_act", "gelu"), ("attention_bias", True)])
def test_config_refuses_unsupported_options(config: ModelConfig, key: str, value) -> None:
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict({**config.to_hf_dict(), key: value})


def test_config_missing_key_is_named(config: ModelConfig) -> None:
    d = config.to_hf_dict()
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig.from_hf_dict(d)


# ---- weights ------------------------------------------------------------------------------------

def test_state_dict_names_are_hf_names(config: ModelConfig, model) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
            "kv_b_proj", "o_proj"]
    mlp = ["gate_proj", "up_proj", "down_proj"]
    for i in range(config.num_kv_layers):
        p = f"model.layers.{i}"
        expected |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        expected |= {f"{p}.self_attn.{a}.weight" for a in attn}
        if i < config.first_k_dense_replace:
            expected |= {f"{p}.mlp.{m}.weight" for m in mlp}
        else:
            expected |= {f"{p}.mlp.gate.weight", f"{p}.mlp.gate.e_score_correction_bias"}
            expected |= {f"{p}.mlp.shared_experts.{m}.weight" for m in mlp}
            expected |= {f"{p}.mlp.experts.{j}.{m}.weight"
                         for j in range(config.n_routed_experts) for m in mlp}
        if i >= config.num_hidden_layers:
            expected |= {f"{p}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj",
                                                     "shared_head.norm", "shared_head.head",
                                                     "embed_tokens")}
    assert set(model.state_dict()) == expected
    assert model.state_dict()["model.layers.4.eh_proj.weight"].shape == (128, 256)


def test_build_model_is_deterministic(config: ModelConfig, model) -> None:
    torch.manual_seed(1234)  # the global RNG must not matter
    again = build_model(config, seed=0)
    other = build_model(config, seed=1)
    for name, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    assert model.mtp_layer(0).shared_head.head.weight is model.lm_head.weight


def test_build_model_same_in_another_process(config: ModelConfig, model) -> None:
    code = ("import dataclasses, torch; from engine.config import ModelConfig; "
            "from engine.model import build_model; "
            f"c = dataclasses.replace(ModelConfig.tiny(), vocab_size={VOCAB}, bos_token_id=1, "
            "eos_token_id=[2, 3]); m = build_model(c, seed=0); "
            "print(sum(float(t.double().sum()) for t in m.state_dict().values()))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert float(out.stdout) == sum(float(t.double().sum()) for t in model.state_dict().values())


def test_save_load_roundtrip(tmp_path: Path, config: ModelConfig, model) -> None:
    save_checkpoint(model, config, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "lm_head.weight" in names and "model.layers.4.shared_head.head.weight" not in names
    loaded, cfg = load_checkpoint(tmp_path)
    assert cfg == config
    assert loaded.mtp_layer(0).embed_tokens.weight is loaded.model.embed_tokens.weight
    kv1, kv2 = ContiguousKvCache(4), ContiguousKvCache(4)
    assert torch.equal(_forward(model, PROMPT, 0, kv1), _forward(loaded, PROMPT, 0, kv2))


def test_load_keeps_distinct_mtp_head(tmp_path: Path, config: ModelConfig, model) -> None:
    save_checkpoint(model, config, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.4.shared_head.head.weight"] = tensors["lm_head.weight"] * 2
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded, _ = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    head = loaded.mtp_layer(0).shared_head.head.weight
    assert head is not loaded.lm_head.weight and head.dtype == torch.bfloat16
    assert torch.equal(head, (tensors["lm_head.weight"] * 2).bfloat16())


def test_load_drops_absent_mtp_and_restores_tied_head(tmp_path: Path,
                                                      config: ModelConfig) -> None:
    # transformers writes num_nextn_predict_layers but no MTP weights; tied lm_head not saved
    tied = dataclasses.replace(config, tie_word_embeddings=True)
    save_checkpoint(build_model(tied, seed=2), tied, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.4.")},
              str(tmp_path / "model.safetensors"))
    loaded, cfg = load_checkpoint(tmp_path)
    assert cfg == dataclasses.replace(tied, num_nextn_predict_layers=0)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert len(reference_generate(loaded, PROMPT, 2)) == 2


def test_config_reads_rope_parameters(config: ModelConfig) -> None:
    d = config.to_hf_dict()
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    assert ModelConfig.from_hf_dict(d).rope_theta == 500.0
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_parameters"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("edit,pattern", [
    ("missing", "missing tensor 'model.layers.2.mlp.experts.3.up_proj.weight'"),
    ("unexpected", "unexpected tensor 'model.layers.9.foo.weight'"),
    ("shape", "tensor 'model.norm.weight': checkpoint shape \\(64,\\)"),
])
def test_loader_errors_name_the_tensor(tmp_path: Path, config: ModelConfig, model,
                                       edit: str, pattern: str) -> None:
    save_checkpoint(model, config, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    if edit == "missing":
        del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    elif edit == "unexpected":
        tensors["model.layers.9.foo.weight"] = torch.zeros(2)
    else:
        tensors["model.norm.weight"] = torch.ones(64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=pattern):
        load_checkpoint(tmp_path)


# ---- forward contract ---------------------------------------------------------------------------

def test_chunked_forward_equals_one_forward(model) -> None:
    whole = _forward(model, PROMPT, 0, ContiguousKvCache(4))
    kv = ContiguousKvCache(4)
    chunks = [_forward(model, PROMPT[s:s + 5], s, kv) for s in range(0, len(PROMPT), 5)]
    assert kv.seq_len(3) == len(PROMPT)
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=0)
    # greedy continuation from the chunked cache equals the reference generator
    out, logits = [], chunks[-1][-1]
    for step in range(8):
        out.append(int(logits.argmax()))
        logits = _forward(model, out[-1:], len(PROMPT) + step, kv)[0]
    assert out == reference_generate(model, PROMPT, 8)


def test_batched_forward_equals_separate(config: ModelConfig, model) -> None:
    a, b = PROMPT[:7], PROMPT[3:15]
    kv = BatchKvCache(2, 4)
    # step 1: both prefill; step 2: a decodes one token while b prefills 3 more
    steps = [((a, 0), (b, 0)), (([11], 7), ([12, 13, 14], 12))]
    sep = [ContiguousKvCache(4), ContiguousKvCache(4)]
    for step in steps:
        ids = torch.tensor([t for s, _ in step for t in s])
        pos = torch.cat([torch.arange(p, p + len(s)) for s, p in step])
        kv.q_lens = [len(s) for s, _ in step]
        with torch.inference_mode():
            batched = model.logits(model(ids, pos, kv.q_lens, kv))
        separate = torch.cat([_forward(model, s, p, c)
                              for (s, p), c in zip(step, sep, strict=True)])
        torch.testing.assert_close(batched, separate, atol=1e-5, rtol=0)


def test_forward_rejects_inconsistent_batch(model) -> None:
    with pytest.raises(ValueError, match="q_lens"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), [2], ContiguousKvCache(4))


def test_routing_keeps_topk_group_groups(config: ModelConfig) -> None:
    c = dataclasses.replace(config, n_routed_experts=16, n_group=4, topk_group=2,
                            num_experts_per_tok=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, c.hidden_size, generator=g)
    w = torch.randn(c.n_routed_experts, c.hidden_size, generator=g) * 0.1
    bias = torch.randn(c.n_routed_experts, generator=g) * 0.1
    ids, weights = route(x, w, bias, c)
    assert ids.shape == weights.shape == (64, 4) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), c.routed_scaling_factor))
    scores = torch.sigmoid(x @ w.T) + bias  # biased scores, [T, E]
    group_scores = scores.view(64, 4, 4).topk(2, dim=-1).values.sum(-1)
    best_groups = group_scores.topk(2, dim=-1).indices
    for t in range(64):
        groups = set((ids[t] // 4).tolist())
        assert groups <= set(best_groups[t].tolist())
        allowed = [e for e in range(16) if e // 4 in groups]
        expected = sorted(sorted(allowed, key=lambda e: -scores[t, e])[:4])
        assert sorted(ids[t].tolist()) == expected
        torch.testing.assert_close(weights[t], torch.sigmoid(x[t] @ w[ids[t]].T)
                                   / torch.sigmoid(x[t] @ w[ids[t]].T).sum() * 2.5)


# ---- reference generator and MTP ----------------------------------------------------------------

def test_reference_generate_stops_at_max_tokens_and_eos(model) -> None:
    free = reference_generate(model, PROMPT, 6)
    assert len(free) == 6 and reference_generate(model, PROMPT, 0) == []
    eos = free[3]
    assert reference_generate(model, PROMPT, 6, {eos}) == free[:free.index(eos) + 1]
    steps = []

    def pick(row: torch.Tensor, step: int) -> int:
        assert row.shape == (VOCAB,) and row.dtype == torch.float32
        steps.append(step)
        return 40 + step

    assert reference_generate(model, PROMPT, 5, frozenset({42}), pick) == [40, 41, 42]
    assert steps == [0, 1, 2]
    with pytest.raises(ValueError, match="token_ids"):
        reference_generate(model, [VOCAB], 3)


def test_mtp_forward_shapes(config: ModelConfig, model) -> None:
    kv = ContiguousKvCache(config.num_kv_layers)
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), [len(PROMPT)], kv)
        nxt = torch.tensor(PROMPT[1:] + [5])
        h = model.mtp_forward(0, hidden, nxt, torch.arange(len(PROMPT)), [len(PROMPT)], kv)
        logits = model.mtp_logits(0, h)
    assert h.shape == (len(PROMPT), config.hidden_size)
    assert logits.shape == (len(PROMPT), VOCAB) and logits.dtype == torch.float32
    assert kv.seq_len(config.num_hidden_layers) == len(PROMPT)  # MTP uses KV layer L + k
    with pytest.raises(IndexError):
        model.mtp_logits(1, h)


def test_bfloat16_model_runs(config: ModelConfig) -> None:
    m = build_model(config, seed=0, dtype=torch.bfloat16)
    assert m.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    out = reference_generate(m, PROMPT, 3)
    assert len(out) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_with_pending_adds_equal_the_unfused_layers_bit_for_bit(config: ModelConfig, dtype) -> None:
    """run_layers leaves each layer's MLP add to the next layer's input RMSNorm (HOT.add_rms_norm,
    one kernel when compiled on a GPU): the same additions in the same order as the plain
    pre-norm block, so on a CPU the hidden states are identical, not just close."""
    m = build_model(dataclasses.replace(config, n_shared_experts=1), seed=3, dtype=dtype)  # routed + shared
    ids = torch.tensor(PROMPT)
    pos = torch.arange(len(PROMPT))
    with torch.no_grad():
        got = m.run_layers(m.model.embed_tokens(ids), pos, [len(PROMPT)], ContiguousKvCache(4))
        x, rope, kv = m.model.embed_tokens(ids), m.rope(pos), ContiguousKvCache(4)
        for layer in m.model.layers[: config.num_hidden_layers]:
            x = x + layer.self_attn(layer.input_layernorm(x), pos, rope, [len(PROMPT)], kv, layer.layer_idx)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    from engine.model import MoE
    kinds = {(isinstance(layer.mlp, MoE), getattr(layer.mlp, "shared_experts", None) is not None)
             for layer in m.model.layers[: config.num_hidden_layers]}
    assert kinds == {(False, False), (True, True)}  # a dense layer, and MoE layers with shared experts
    assert torch.equal(got, x)
