"""CPU smoke tests of tools/train_small.py and tools/mtp_accept.py (a tiny config, ~20 steps)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import mtp_accept  # noqa: E402  (tools/)
import train_small  # noqa: E402  (tools/)
from common.tokenizer import load_tokenizer  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.model import build_model  # noqa: E402
from engine.model_source import load_model  # noqa: E402
from engine.reference import reference_generate  # noqa: E402

DATA = train_small.default_data()
pytestmark = [pytest.mark.skipif(not DATA.exists(), reason=f"{DATA} is missing"),
              pytest.mark.usefixtures("one_torch_thread")]

TINY_ARGS = ["--data", str(DATA), "--max-chars", "120000", "--vocab-size", "384",
             "--seq-len", "32", "--batch-size", "8", "--layers", "3", "--hidden", "64",
             "--heads", "2", "--q-lora-rank", "32", "--kv-lora-rank", "32", "--qk-nope-dim", "16",
             "--qk-rope-dim", "8", "--v-dim", "16", "--intermediate", "128",
             "--moe-intermediate", "32", "--steps", "20", "--warmup", "4", "--lr", "3e-3",
             "--eval-every", "10", "--log-every", "5", "--eval-windows", "32", "--threads", "1",
             "--device", "cpu", "--quiet", "--seed", "7"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ckpt")
    return out, train_small.main(["--out", str(out), *TINY_ARGS])


def test_batched_forward_matches_engine() -> None:
    # float32, no dropout: the training forward (batched attention, dense MoE) against the
    # engine's own forward/mtp_forward, values and gradients (so the engine path trains too)
    c = dataclasses.replace(ModelConfig.tiny(), vocab_size=300, bos_token_id=0, eos_token_id=0)
    model = build_model(c, seed=3)
    train_small.init_for_training(model)
    with torch.no_grad():  # non-zero routing biases, as after some balancing steps
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(1))
    windows = torch.randint(0, 300, (3, 26), generator=torch.Generator().manual_seed(0))
    got = {}
    for impl in ("engine", "batched"):
        model.zero_grad(set_to_none=True)
        hidden, mtp_hidden, _ = train_small.train_forward(model, windows[:, :24],
                                                          windows[:, 1:25], 0.0, impl)
        main, mtp, _ = train_small.losses(model, windows, 0.0, impl)
        (main + 0.3 * mtp).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        got[impl] = (hidden.detach(), mtp_hidden.detach(), grads)
    (he, me, ge), (hb, mb, gb) = got["engine"], got["batched"]
    torch.testing.assert_close(hb, he, rtol=0, atol=1e-5)
    torch.testing.assert_close(mb, me, rtol=0, atol=1e-5)
    assert ge.keys() == gb.keys() and len(ge) == len(list(model.parameters()))
    for name in ge:
        scale = ge[name].abs().max().item() + 1e-12
        assert (gb[name] - ge[name]).abs().max().item() <= 1e-4 * scale, name


def test_tokenizer_round_trip_and_split() -> None:
    text = DATA.read_text(encoding="utf-8")[:60000]
    train, val = train_small.split_text(text)
    assert train + val == text and val.startswith(text[len(train):]) and train.endswith("\n")
    assert 0.08 < len(val) / len(text) < 0.12
    tok = train_small.train_tokenizer(train, 300)
    assert tok.get_vocab_size() == 300 and tok.token_to_id(train_small.EOT) == 0
    sample = val + " Ünïcödé — ✓\n"
    assert tok.decode(tok.encode(sample, add_special_tokens=False).ids) == sample
    assert train_small.train_tokenizer(train, 300).to_str() == tok.to_str()  # deterministic


def test_train_smoke(trained: tuple[Path, dict]) -> None:
    out, summary = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training_log.json",
                 "README.md", "LICENSE"):
        assert (out / name).exists(), name
    rows = [r for r in summary["log"] if "train_loss" in r]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 0.3
    vals = [r["val_loss"] for r in summary["log"] if "val_loss" in r]
    assert min(vals) < 5.5  # ln(384) = 5.95 at the start
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 20 and log["saved_step"] == log["best"]["step"]
    assert log["checkpoint_bytes"] == (out / "model.safetensors").stat().st_size

    loaded = load_model(str(out))
    assert loaded.config.num_nextn_predict_layers == 1
    assert loaded.model.dtype == torch.float32
    assert loaded.config.vocab_size == 384 and loaded.config.eos_token_id == 0
    # MTP embed/head are not stored twice but are shared again on load
    mtp = loaded.model.mtp_layer(0)
    assert mtp.embed_tokens.weight is loaded.model.model.embed_tokens.weight
    assert mtp.shared_head.head.weight is loaded.model.lm_head.weight
    stored = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for n, t in stored.items()
               if not n.endswith("e_score_correction_bias"))
    assert torch.equal(stored["lm_head.weight"].float(), loaded.model.lm_head.weight)
    # the float32 evaluation in the summary is of exactly the loaded weights
    val = train_small.val_windows(
        train_small.encode(load_tokenizer(out).tokenizer,
                           train_small.split_text(DATA.read_text()[:120000])[1]), 34, 32, 32)
    vl, _ = train_small.evaluate(loaded.model, val, 8)
    assert abs(vl - summary["val_loss"]) < 1e-4

    tok = load_tokenizer(out)
    ids = tok.encode("ROMEO:\nBut soft, what light")
    assert tok.decode(ids) == "ROMEO:\nBut soft, what light"
    gen = reference_generate(loaded.model, ids, 8, loaded.config.eos_token_ids)
    assert 1 <= len(gen) <= 8 and all(0 <= t < 384 for t in gen)
    assert isinstance(tok.decode(gen), str)


def test_same_seed_same_weights(trained: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = trained
    train_small.main(["--out", str(tmp_path), *TINY_ARGS])
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert (out / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()


def test_mtp_accept(trained: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = trained
    result = mtp_accept.main([str(out), "--data", str(DATA), "--max-chars", "120000", "--k", "3",
                              "--positions", "40", "--window", "32",
                              "--json", str(tmp_path / "a.json")])
    assert result["positions"] == 40
    for k in (1, 2, 3):
        assert 1.0 <= result["accept_length"][k] <= k + 1
    acc = result["accept_length"]
    assert acc[1] <= acc[2] <= acc[3]
    assert json.loads((tmp_path / "a.json").read_text())["positions"] == 40


def test_mtp_accept_targets_and_drafts(trained: tuple[Path, dict]) -> None:
    # the cached fork path agrees with plain un-forked computations: the targets with
    # reference_generate after ids[0..t], draft 1 with a full-sequence mtp_forward over the
    # pairs (hidden at p, ids[p+1]) for p < t and (hidden at t, T1)
    out, _ = trained
    model = load_model(str(out)).model
    ids = torch.randint(0, 384, (20,), generator=torch.Generator().manual_seed(5))
    kv, hidden, greedy = mtp_accept.prefill_window(model, ids)
    for t in (3, 11, 16):
        targets, drafts = mtp_accept.targets_and_drafts(model, kv, hidden, greedy, t, 3)
        assert targets == reference_generate(model, ids[:t + 1].tolist(), 4)
        with torch.inference_mode():
            nxt = torch.cat((ids[1:t + 1], torch.tensor([targets[0]])))
            pos = torch.arange(t + 1)
            h = model.mtp_forward(0, hidden[:t + 1], nxt, pos, [t + 1],
                                  mtp_accept.RecordingKv())
            assert drafts[0] == int(model.mtp_logits(0, h[-1:])[0].argmax())
