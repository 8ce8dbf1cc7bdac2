"""Checkpoints in the Hugging Face layout: `config.json` plus safetensors.

Reads `model.safetensors` or a sharded `model.safetensors.index.json` (as published DeepSeek-V3
checkpoints). Each tensor goes through a per-parameter loader function chosen by name pattern
(nano-vllm `utils/loader.py` style), so an expert-parallel rank can plug in a loader that keeps
only its own experts. FP8 block-quantized checkpoints (`weight_scale_inv`) are not supported:
`ModelConfig.from_hf_dict` refuses their `quantization_config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from os import PathLike
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.model import DeepseekV3ForCausalLM, tied_aliases

WeightLoader = Callable[[torch.Tensor, torch.Tensor, str], None]
"""loader(param, loaded, name): copy checkpoint tensor `loaded` into model tensor `param`."""

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Default loader: same shape, cast to the parameter's dtype and device.

    Raises ValueError naming the tensor on a shape mismatch.
    """
    if param.shape != loaded.shape:
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(loaded.shape)}, "
                         f"model expects {tuple(param.shape)}")
    param.copy_(loaded)


# Regex (full match) -> loader; the first matching entry wins, so put specific patterns first:
# load_weights(model, tensors, {r"model\.layers\.\d+\.mlp\.experts\..*": mine, **DEFAULT_LOADERS})
DEFAULT_LOADERS: dict[str, WeightLoader] = {r".*": copy_weight}


@torch.no_grad()
def load_weights(model: DeepseekV3ForCausalLM, names: list[str],
                 get_tensor: Callable[[str], torch.Tensor],
                 loaders: Mapping[str, WeightLoader] | None = None) -> None:
    """Fill every model tensor from a checkpoint holding `names` (read through `get_tensor`).

    MTP embed_tokens / shared_head.head (and lm_head when tie_word_embeddings) may be absent:
    they are then shared with the main embedding / lm_head, as they are when present and equal.
    Raises ValueError naming the first missing, unexpected or shape-mismatched tensor.
    """
    loaders = DEFAULT_LOADERS if loaders is None else loaders
    compiled = [(re.compile(p), fn) for p, fn in loaders.items()]
    optional = tied_aliases(model.config)
    params = model.state_dict(keep_vars=True)
    present = set(names)
    unexpected = sorted(present - params.keys())
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} in checkpoint "
                         f"({len(unexpected)} unexpected)")
    missing = sorted(params.keys() - present - optional.keys())
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in checkpoint ({len(missing)} missing)")
    # Load tied tensors under their own names (they are untied first, so a checkpoint whose
    # MTP head differs from lm_head keeps both), then re-share what the checkpoint shares.
    _untie(model, optional)
    params = model.state_dict(keep_vars=True)
    tied_head = model.config.tie_word_embeddings and "lm_head.weight" in present
    for name in names:
        if tied_head and name == "lm_head.weight":
            continue  # same storage as the embedding: checked against it below
        fn = next((f for pat, f in compiled if pat.fullmatch(name)), None)
        if fn is None:
            raise ValueError(f"tensor {name!r}: no loader pattern matches")
        fn(params[name], get_tensor(name), name)
    if tied_head:
        head = get_tensor("lm_head.weight")
        embed = params["model.embed_tokens.weight"]
        if head.shape != embed.shape or not torch.equal(head.to(embed), embed):
            raise ValueError("tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                             "but tie_word_embeddings is true")
    for name, source in optional.items():
        if name not in present or torch.equal(params[name], params[source]):
            _share(model, name, source)


def _untie(model: DeepseekV3ForCausalLM, optional: Mapping[str, str]) -> None:
    for name, source in optional.items():
        if name == "lm_head.weight":  # tie_word_embeddings is architecture: never untied
            continue
        module, attr = _owner(model, name)
        param = getattr(module, attr)
        src_module, src_attr = _owner(model, source)
        if param is not getattr(src_module, src_attr):
            continue
        setattr(module, attr, torch.nn.Parameter(param.detach().clone(),
                                                 requires_grad=param.requires_grad))


def _share(model: DeepseekV3ForCausalLM, name: str, source: str) -> None:
    src_module, src_attr = _owner(model, source)
    module, attr = _owner(model, name)
    setattr(module, attr, getattr(src_module, src_attr))


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def save_checkpoint(model: DeepseekV3ForCausalLM, config: ModelConfig,
                    directory: str | PathLike[str]) -> None:
    """Write `config.json` (HF dict plus torch_dtype) and `model.safetensors` to `directory`.

    A tied alias (MTP embed/head sharing the main ones, lm_head under tie_word_embeddings) is
    not written; `load_checkpoint` restores the sharing.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    params = model.state_dict(keep_vars=True)
    aliases = tied_aliases(config)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in params.items()
               if not (name in aliases and t is params[aliases[name]])}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    # safetensors writes 0600; a checkpoint is read by serving processes of other users.
    os.chmod(out / WEIGHTS_FILE, 0o644)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (out / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")


def checkpoint_files(directory: str | PathLike[str]) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index file or the single weights file.

    Raises FileNotFoundError when neither exists.
    """
    d = Path(directory)
    if (d / INDEX_FILE).exists():
        weight_map = json.loads((d / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        return {name: d / file for name, file in weight_map.items()}
    if not (d / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"{d}: neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
        return {name: d / WEIGHTS_FILE for name in f.keys()}


def _drop_absent_mtp(config: ModelConfig, names: Mapping[str, object]) -> ModelConfig:
    # transformers writes num_nextn_predict_layers (default 1) but never saves MTP weights, so
    # trailing MTP modules with no tensor at all are dropped from the config (a partly present
    # module still fails as missing tensors).
    n = config.num_nextn_predict_layers
    while n > 0 and not any(name.startswith(f"model.layers.{config.num_hidden_layers + n - 1}.")
                            for name in names):
        n -= 1
    return config if n == config.num_nextn_predict_layers else dataclasses.replace(
        config, num_nextn_predict_layers=n)


def load_checkpoint(directory: str | PathLike[str], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu",
                    loaders: Mapping[str, WeightLoader] | None = None
                    ) -> tuple[DeepseekV3ForCausalLM, ModelConfig]:
    """Read `config.json` and the weights of an HF-layout checkpoint (model in eval mode,
    without gradients).

    Tensors are cast to `dtype` (e_score_correction_bias stays float32). MTP modules with no
    tensor in the checkpoint are dropped: the returned config's num_nextn_predict_layers says
    how many were loaded. Raises ValueError for a bad config or a missing/unexpected/mis-shaped
    tensor, FileNotFoundError for missing files.
    """
    d = Path(directory)
    config = ModelConfig.from_json_file(d / CONFIG_FILE)
    files = checkpoint_files(d)
    config = _drop_absent_mtp(config, files)
    model = DeepseekV3ForCausalLM(config, dtype=dtype, device=device)
    handles: dict[Path, object] = {}

    def get_tensor(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:  # open each shard once; tensors are read lazily, one at a time
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(name)  # type: ignore[attr-defined]

    load_weights(model, sorted(files), get_tensor, loaders)
    return model.eval().requires_grad_(False), config
