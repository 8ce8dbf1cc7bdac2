"""KV cache storage dtypes: FP8 bytes per token and the FP8 logits tolerance (docs/bench/prefill.md)."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache, kv_cache_torch_dtype
from engine.pipeline import partition_layers
from engine.runner import ModelRunner

# Measured on the shipped trained model (docs/bench/prefill.md): FP8 against the BF16 KV path,
# max |Δ logit| 0.04-0.10 (logits span ±11-15), KL(bf16 || fp8) ≤ 3e-4, same greedy token.
FP8_MAX_ABS_LOGIT = 0.15
FP8_MAX_KL = 1e-3

PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.",
    "KING RICHARD III:\nNow is the winter of our discontent made glorious summer by this sun of York;",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune" * 3,
]


@pytest.fixture(scope="module")
def shakespeare(one_torch_thread):
    from engine.model_source import SHAKESPEARE, load_model
    return load_model(SHAKESPEARE)


def first_token_logits(loaded, dtype: torch.dtype, prompt: list[int], chunk: int = 32) -> torch.Tensor:
    cfg = loaded.config
    pool = KvPool(KvPoolConfig(64, 16, cfg.num_hidden_layers, cfg.kv_dim, dtype=dtype), 1)
    runner = ModelRunner(loaded.model, pool)
    blocks = list(range(pool.blocks_for(len(prompt))))
    hidden = None
    for s in range(0, len(prompt), chunk):  # chunks read earlier chunks' stored (FP8) KV back
        hidden = runner.prefill_chunk(blocks, prompt, s, min(s + chunk, len(prompt)))
    return runner.logits(hidden)


@pytest.mark.parametrize("text", PROMPTS)
def test_fp8_first_token_logits_within_tolerance_of_bf16(shakespeare, text):
    prompt = shakespeare.tokenizer().encode(text)
    bf16 = first_token_logits(shakespeare, torch.bfloat16, prompt)
    fp8 = first_token_logits(shakespeare, torch.float8_e4m3fn, prompt)
    assert (fp8 - bf16).abs().max().item() <= FP8_MAX_ABS_LOGIT
    p, q = bf16.log_softmax(-1), fp8.log_softmax(-1)
    assert (p.exp() * (p - q)).sum().item() <= FP8_MAX_KL
    assert int(fp8.argmax()) == int(bf16.argmax())
    # and it is really quantized: FP8 differs from BF16 more than BF16 from float32
    f32 = first_token_logits(shakespeare, torch.float32, prompt)
    assert (fp8 - f32).abs().max() > (bf16 - f32).abs().max()


def test_fp8_pool_bytes_are_half_of_bf16():
    from engine.config import ModelConfig
    c = ModelConfig.tiny()
    cfg = {dt: KvPoolConfig(8, 16, c.num_hidden_layers, c.kv_dim, dtype=kv_cache_torch_dtype(dt, torch.float32))
           for dt in ("auto", "bf16", "fp8_e4m3")}
    assert cfg["fp8_e4m3"].bytes_per_token == (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers * 1
    assert cfg["bf16"].bytes_per_token == 2 * cfg["fp8_e4m3"].bytes_per_token
    assert cfg["auto"].bytes_per_token == 4 * cfg["fp8_e4m3"].bytes_per_token
    pools = {dt: KvPool(k, 1) for dt, k in cfg.items()}
    assert pools["bf16"].kv.nbytes == 2 * pools["fp8_e4m3"].kv.nbytes
    assert pools["fp8_e4m3"].kv.dtype == torch.float8_e4m3fn
    assert cfg["fp8_e4m3"].dtype_name == "float8_e4m3fn"


def test_fp8_saturates_instead_of_nan_and_uses_the_scale():
    pool = KvPool(KvPoolConfig(4, 4, 1, 3, dtype=torch.float8_e4m3fn, scale=4.0), 1)
    latent = torch.tensor([[4000.0, -4000.0, 1.0], [2.0, 0.5, -8.0]])
    out = PagedKvCache(pool, [([0], 0, 2)]).update(0, latent)[0]
    assert torch.isfinite(out).all()
    assert out[0, 0] == 448 * 4.0 and out[0, 1] == -448 * 4.0  # e4m3 max times the scale
    torch.testing.assert_close(out[1], latent[1])  # exactly representable after / 4


def test_kv_cache_dtype_names_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv_cache_torch_dtype("int8", torch.float32)
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_layer_partition():
    assert partition_layers(4, 1) == [(0, 4)]
    assert partition_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert partition_layers(4, 2, "3,1") == [(0, 3), (3, 4)]
    for bad in ("3,2", "4,0", "x,y", "4"):
        with pytest.raises(ValueError, match="--pp-layer-partition"):
            partition_layers(4, 2, bad)
    with pytest.raises(ValueError, match="--pp-size"):
        partition_layers(2, 3)


def _decode_options(argv: list[str]):
    from cli import config
    from cli.flags import build
    from cli.main import build_parser
    from worker.host import WorkerOptions
    parser = build_parser()
    args = parser.parse_args(["prefill", *argv])
    config.apply(parser, args)
    return build(WorkerOptions, args)


def test_worker_flags_alias_and_bool(monkeypatch):
    monkeypatch.setenv("TANDEM_CHUNK_SIZE", "96")
    monkeypatch.setenv("TANDEM_ENABLE_DYNAMIC_CHUNKING", "true")
    opts = _decode_options([])
    assert opts.chunk_size == 96 and opts.enable_dynamic_chunking
    opts = _decode_options(["--chunk-size", "48", "--no-enable-dynamic-chunking", "--kv-cache-dtype", "fp8_e4m3",
                            "--pp-size", "2"])
    assert (opts.chunk_size, opts.enable_dynamic_chunking, opts.kv_cache_dtype, opts.pp_size) == \
        (48, False, "fp8_e4m3", 2)
    assert _decode_options(["--chunked-prefill-size", "64"]).chunk_size == 64  # SGLang's spelling
    with pytest.raises(SystemExit, match="kv-cache-dtype"):
        _decode_options(["--kv-cache-dtype", "fp4"])
