"""Which model a process serves: the seeded tiny model, or a Hugging Face checkpoint folder.

Every process that must agree on the weights (workers, and the demo's in-process
reference) loads them through `load_model` with the same spec and seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from common.tokenizer import TextTokenizer, load_tokenizer
from engine.config import ModelConfig

TINY = "tandem-tiny"  # ModelConfig.tiny() with weights from `seed` (tests: any vocabulary id is valid)
SHAKESPEARE = "tandem-shakespeare"  # the shipped trained checkpoint (docs/model-card.md)
MOCK = "tandem-mock"  # config only, no weights: served by the simulated workers of `tandem mocker`
SHIPPED = {name: Path(__file__).resolve().parent / "assets" / name for name in (SHAKESPEARE, MOCK)}
DEFAULT_MODEL = SHAKESPEARE


@dataclass
class LoadedModel:
    name: str  # served model name (enters the block-hash seed)
    config: ModelConfig
    model: torch.nn.Module
    checkpoint_dir: Path | None
    fingerprint: str = ""  # weights_fingerprint(): published in discovery, enters the block-hash seed

    def tokenizer(self) -> TextTokenizer:
        return load_tokenizer(self.checkpoint_dir)


def _folder(spec: str) -> Path:
    return SHIPPED.get(spec, Path(spec))


def missing_model(spec: str) -> FileNotFoundError | None:
    """Why --model `spec` cannot be served (the error the workers would raise at start), or None
    for a built-in name or a folder with a config.json. Cheap: nothing but the folder is read."""
    if spec in ("", TINY):
        return None
    path = _folder(spec)
    if (path / "config.json").exists():
        return None
    what = "no config.json there" if path.is_dir() else "no such built-in model or folder"
    return FileNotFoundError(f"--model {spec}: {what} (built-in: {SHAKESPEARE}, {TINY}; or a Hugging Face "
                             f"checkpoint folder)")


def model_name(spec: str) -> str:
    """The served name for a spec without loading it: TINY, a shipped model's name, or the folder's name."""
    return TINY if spec in ("", TINY) else _folder(spec).resolve().name


def load_config(spec: str = DEFAULT_MODEL) -> tuple[str, ModelConfig, Path | None]:
    """(served name, config, checkpoint folder or None) without building weights (the router's need).

    Raises:
        FileNotFoundError: the folder has no config.json.
    """
    if spec in ("", TINY):
        return TINY, ModelConfig.tiny(), None
    path = _folder(spec)
    if (missing := missing_model(spec)) is not None:
        raise missing
    return model_name(spec), ModelConfig.from_json_file(path / "config.json"), path


SAMPLE_BYTES = 1 << 20  # tensor bytes read from each end of every safetensors file for the fingerprint


def _safetensors_digest(path: Path, h) -> None:
    """Feed `h` a file's safetensors header (names, dtypes, shapes, offsets) and SAMPLE_BYTES
    of tensor data from each end: a cheap stand-in for hashing every byte, which tells apart
    checkpoints of one architecture trained differently without reading gigabytes at start-up."""
    size = path.stat().st_size
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h.update(f.read(n))
        data_start = 8 + n
        h.update(f.read(min(SAMPLE_BYTES, size - data_start)))
        f.seek(max(data_start, size - SAMPLE_BYTES))
        h.update(f.read())
    h.update(struct.pack("<Q", size))


def weights_fingerprint(config: ModelConfig, checkpoint_dir: Path | None = None, seed: int | None = None) -> str:
    """Identity of a model's weights (16 hex digits), published in discovery and mixed into the
    block-hash seed so workers with one model name but other weights are never used together.

    A checkpoint folder: config plus every safetensors file's header and sampled tensor bytes
    (`_safetensors_digest`); a seeded model (tandem-tiny): config plus the seed.
    """
    h = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    if checkpoint_dir is None:
        h.update(f"seed={seed}".encode())
    else:
        from engine.loader import checkpoint_files
        for path in sorted(set(checkpoint_files(checkpoint_dir).values())):
            h.update(path.name.encode() + b"\x00")
            _safetensors_digest(path, h)
    return h.hexdigest()[:16]


def load_model(spec: str = DEFAULT_MODEL, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load `spec`: TINY (seeded weights), a shipped model's name, or a folder with
    config.json + model.safetensors (+ tokenizer.json).

    Raises:
        FileNotFoundError: the folder or its config.json is missing.
        ValueError: the checkpoint does not match its config (the loader names the tensor).
    """
    from engine.loader import load_checkpoint
    from engine.model import build_model

    if spec in ("", TINY):
        config = ModelConfig.tiny()
        return LoadedModel(TINY, config, build_model(config, seed=seed, dtype=dtype).eval(), None,
                           weights_fingerprint(config, seed=seed))
    path = _folder(spec)
    if (missing := missing_model(spec)) is not None:
        raise missing
    model, config = load_checkpoint(path, dtype=dtype)
    return LoadedModel(model_name(spec), config, model.eval(), path, weights_fingerprint(config, path))
