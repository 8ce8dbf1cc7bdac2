"""Model configuration with Hugging Face `DeepseekV3Config` field names.

Field names and meanings follow `transformers/models/deepseek_v3/configuration_deepseek_v3.py`
and the `config.json` of the DeepSeek-V3 checkpoints, so a real `config.json` maps onto this class
one to one. Options the engine does not implement (YaRN `rope_scaling`, attention biases, FP8
`quantization_config`, other activations or scoring functions) are refused by `from_hf_dict`
with a `ValueError` instead of being ignored, because ignoring them would silently change outputs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from os import PathLike
from typing import Any

# HF config keys whose other values change the model's outputs in ways this engine does not
# implement; from_hf_dict refuses those values. Every other unknown key (architectures,
# model_type, torch_dtype, num_key_value_heads, ...) is ignored.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # key: values we can run (a key absent from the dict is always fine)
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "rope_scaling": (None,),
    "quantization_config": (None,),
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
}


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-architecture model (DeepSeek-V3 technical report, arXiv:2412.19437).

    Sizes are counts of elements; `*_head_dim` are per attention head. Derived values are
    properties. Raises `ValueError` naming the field on construction when a value is out of range.
    """

    vocab_size: int  # number of token ids (embedding and lm_head rows)
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the dense MLP (layers < first_k_dense_replace)
    moe_intermediate_size: int  # width of one routed expert's MLP (and of one shared expert)
    num_hidden_layers: int  # decoder layers of the main model (MTP layers not included)
    num_attention_heads: int  # query heads of MLA
    q_lora_rank: int | None  # rank of the query down-projection; None = plain q_proj (V2-Lite)
    kv_lora_rank: int  # width of the compressed KV latent (the cached part besides the rope key)
    qk_nope_head_dim: int  # per-head query/key width without rotary embedding
    qk_rope_head_dim: int  # per-head query/key width with rotary embedding (shared key, even)
    v_head_dim: int  # per-head value width
    n_routed_experts: int  # routed experts per MoE layer
    num_experts_per_tok: int  # routed experts each token is sent to (top-k)
    n_shared_experts: int  # shared experts per MoE layer (fused into one MLP); 0 = none
    n_group: int  # expert groups for group-limited routing (experts split evenly)
    topk_group: int  # groups a token may route to
    routed_scaling_factor: float  # multiplier applied to the routed experts' gate weights
    norm_topk_prob: bool  # renormalise the top-k gate weights to sum to 1 before scaling
    first_k_dense_replace: int  # the first k layers use a dense MLP instead of MoE
    num_nextn_predict_layers: int  # MTP (multi-token prediction) modules after the main layers
    max_position_embeddings: int  # longest context (prompt + generated tokens) in tokens
    rope_theta: float  # RoPE base frequency
    rms_norm_eps: float  # epsilon of the hidden-size RMSNorms
    initializer_range: float  # std of the normal init of weight matrices (build_model)
    bos_token_id: int  # beginning-of-sequence token id
    eos_token_id: int | tuple[int, ...]  # end-of-sequence id(s); a list is stored as a tuple
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    rope_interleave: bool = True  # rope dims are stored interleaved (HF permutes before rotating)

    def __post_init__(self) -> None:
        # A list (as in config.json) becomes a tuple so the frozen config stays hashable.
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    # ---- validation -------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every field; raise `ValueError` naming the first bad field."""

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                     "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings"):
            need(is_int(getattr(self, name)) and getattr(self, name) > 0, name,
                 "must be a positive int")
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 0, name,
                 "must be an int >= 0")
        need(self.q_lora_rank is None or (is_int(self.q_lora_rank) and self.q_lora_rank > 0),
             "q_lora_rank", "must be None or a positive int")
        # rotate_half splits the rope dims in two halves
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        need(self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             "must be <= num_hidden_layers")
        need(self.n_routed_experts % self.n_group == 0, "n_group",
             "must divide n_routed_experts")
        # the group score is the sum of the top-2 expert scores of the group (HF / DeepSeek-V3)
        need(self.n_routed_experts // self.n_group >= 2, "n_group",
             "each group needs at least 2 experts")
        need(self.topk_group <= self.n_group, "topk_group", "must be <= n_group")
        need(self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
             "num_experts_per_tok", "must be <= topk_group * experts per group")
        for name in ("routed_scaling_factor", "rope_theta", "rms_norm_eps", "initializer_range"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, name,
                 "must be a positive number")
        for name in ("norm_topk_prob", "tie_word_embeddings", "rope_interleave"):
            need(isinstance(getattr(self, name), bool), name, "must be a bool")
        need(is_int(self.bos_token_id) and 0 <= self.bos_token_id < self.vocab_size,
             "bos_token_id", "must be a token id < vocab_size")
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        need(len(eos) > 0 and all(is_int(t) and 0 <= t < self.vocab_size for t in eos),
             "eos_token_id", "must be a token id or a non-empty list of ids < vocab_size")

    # ---- derived values ---------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Values cached per token per layer (MLA latent): kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache KV: the main layers plus the MTP layers (index L + k)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """`eos_token_id` as a set, whether it was given as one id or a list."""
        eos = self.eos_token_id
        return frozenset(eos) if isinstance(eos, tuple) else frozenset((eos,))

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """KV cache bytes per token over all KV layers."""
        return self.kv_dim * self.num_kv_layers * bytes_per_element

    # ---- HF config.json ---------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a HF `config.json` dict; unknown keys are ignored.

        Newer transformers store `rope_theta` inside `rope_parameters`; both forms are read.
        Raises `ValueError` naming the key for a missing field or an unsupported option.
        """
        for key, ok in _UNSUPPORTED.items():
            if key in d and d[key] not in ok:
                raise ValueError(f"config key {key}={d[key]!r} is not supported (supported: {ok})")
        d = dict(d)
        # transformers' DeepseekV3Config has no such field (it drops MTP weights on load), so
        # a config.json it wrote may lack it: that checkpoint holds no MTP module.
        d.setdefault("num_nextn_predict_layers", 0)
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, dict):
            if rope_params.get("rope_type", "default") != "default":
                raise ValueError(f"config key rope_parameters={rope_params!r} is not supported "
                                 "(only rope_type 'default')")
            d.setdefault("rope_theta", rope_params.get("rope_theta"))
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            # q_lora_rank may legitimately be null (no query compression)
            if f.name in d and (d[f.name] is not None or f.name == "q_lora_rank"):
                kwargs[f.name] = d[f.name]
            elif f.default is dataclasses.MISSING:
                raise ValueError(f"config key {f.name!r} is missing")
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` dict (with architectures and model_type)."""
        d: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"],
                             "model_type": "deepseek_v3"}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        # Implied by the architecture, but transformers' defaults differ (num_key_value_heads
        # defaults to 128), so they are written out for the file to load there as well.
        d.update(num_key_value_heads=self.num_attention_heads, hidden_act="silu",
                 attention_bias=False)
        return d

    @classmethod
    def from_json_file(cls, path: str | PathLike[str]) -> ModelConfig:
        """Read a HF `config.json`. Raises `ValueError` as `from_hf_dict`, OSError on I/O."""
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))

    # ---- presets ----------------------------------------------------------------------------

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The default test/demo model: every DeepSeek-V3 part, small enough for a CPU.

        vocab_size is the Qwen2 tokenizer's (151,643 + 3 special tokens) so real text can be
        tokenized; tests shrink it with `dataclasses.replace` for speed.
        """
        return cls(
            vocab_size=151646, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=64,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            num_nextn_predict_layers=1, max_position_embeddings=4096, rope_theta=10000.0,
            rms_norm_eps=1e-6, initializer_range=0.02, bos_token_id=151643,
            eos_token_id=[151643, 151645],  # type: ignore[arg-type]  # stored as a tuple
        )
