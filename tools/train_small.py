"""Train a small DeepSeek-V3-architecture model on Tiny Shakespeare with the engine's own model.

Usage (GPU; the defaults take about 45 s on one H200, start-up included):

    python tools/train_small.py --out out_dir --max-minutes 13

The data, not the compute, limits this model: Tiny Shakespeare is ~308K training tokens, and a
20M-parameter model memorises it (validation loss is lowest after ~20 epochs with dropout 0.2,
then climbs; measured on an H200, see the defaults). So the schedule is planned over
`--epochs` (20); `--max-minutes` is a cap (training stops and saves when it is reached), and
`--epochs 0` plans the cosine over the steps the time budget allows instead (measured over the
first 30 steps). The weights of the best validation evaluation are saved (`--save best`).

The model is `engine.model.DeepseekV3ForCausalLM` (built by `build_model`, config
`engine.config.ModelConfig`), saved by `engine.loader.save_checkpoint`, so the folder loads with
`engine.model_source.load_model(out_dir)` and serves like any Hugging Face checkpoint. The folder
also gets `tokenizer.json` (a byte-level BPE trained here on the training split), README.md and
LICENSE (the training text is public domain), `training_log.json` and `loss_curve.png`
(matplotlib permitting; `tools/plot_loss.py` draws it from the log too).

Training forward: the engine's forward runs attention one sequence at a time and its MoE
syncs with the host once per expert. For speed, `train_forward` below runs the SAME modules
and weights with batched attention (`scaled_dot_product_attention` over [B, heads, S, S]) and
a dense MoE (every expert on every token, weighted by the engine's own `route` gate, zero for
the experts not chosen). tests/test_train_small.py checks in float32 that it matches the
engine's forward (`--impl engine`, which trains through `model(...)` / `model.mtp_forward`
with a `WindowKvCache`) to 1e-5. Training-only extras the engine does not run: dropout on the
residual branches, and DeepSeek-V3's auxiliary-loss-free balancing (section 2.1.2): after each
step every MoE layer's `e_score_correction_bias` moves by `--bias-update` towards equal
expert loads.

Loss: next-token cross-entropy plus `--mtp-weight` x the MTP module's cross-entropy (token t+2
from the main model's final-normed hidden at t, what `mtp_forward` takes as prev_hidden, and
the embedding of token t+1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from engine.loader import CONFIG_FILE, WEIGHTS_FILE, save_checkpoint  # noqa: E402
from engine.model import (  # noqa: E402
    DecoderLayer,
    DeepseekV3ForCausalLM,
    MLAttention,
    MoE,
    apply_rope,
    build_model,
    route,
    tied_aliases,
)

EOT = "<|endoftext|>"  # the tokenizer's only special token: bos and eos
DATA_CANDIDATES = (ROOT.parent / "shared/datasets/corpus/tinyshakespeare/input.txt",
                   ROOT / "shared/datasets/corpus/tinyshakespeare/input.txt")
VAL_FRACTION = 0.1  # the last 10 % of the text (cut at a line start) is the validation split
RESERVE_S = 25.0  # of --max-minutes kept for the final evaluation, saving and plotting


# ---- data ------------------------------------------------------------------------------------

def default_data() -> Path:
    """The Tiny Shakespeare file: ../shared/datasets/... beside the repo, else shared/ inside."""
    return next((p for p in DATA_CANDIDATES if p.exists()), DATA_CANDIDATES[0])


def read_text(path: str, tool: str = "tools/train_small.py") -> str:
    """The training text at `path`; a missing file exits with what to do (not a traceback)."""
    p = Path(path)
    if not p.is_file():
        raise SystemExit(
            f"{tool}: no training text at {p}. It expects Tiny Shakespeare (the public-domain input.txt of "
            f"karpathy/char-rnn, data/tinyshakespeare/, about 1.1 MB) at "
            f"../shared/datasets/corpus/tinyshakespeare/input.txt beside the repository; put it there, "
            f"or pass --data FILE (any UTF-8 text file).")
    return p.read_text(encoding="utf-8")


def split_text(text: str) -> tuple[str, str]:
    """(train, validation): validation is the last VAL_FRACTION, starting at a line start."""
    cut = int(len(text) * (1 - VAL_FRACTION))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl >= 0 else cut
    return text[:cut], text[cut:]


def train_tokenizer(text: str, vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2 pre-tokenizer, ByteLevel decoder: decode(encode(s)) == s) with
    EOT as id 0, trained on `text` with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = text.splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 64]) for i in range(0, len(lines), 64)]
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    return tok


def encode(tok: Any, text: str) -> torch.Tensor:
    """Token ids [N] (int64) of `text`, as `common.tokenizer.TextTokenizer.encode`."""
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def sample_windows(data: torch.Tensor, batch: int, length: int,
                   gen: torch.Generator) -> torch.Tensor:
    """[batch, length] random contiguous windows of data [N] (starts drawn from `gen`, CPU)."""
    starts = torch.randint(0, data.numel() - length + 1, (batch,), generator=gen)
    idx = starts.to(data.device)[:, None] + torch.arange(length, device=data.device)[None, :]
    return data[idx]


def val_windows(data: torch.Tensor, length: int, stride: int, limit: int) -> torch.Tensor:
    """The fixed validation set: up to `limit` evenly spread windows [n, length] of data [N],
    from non-overlapping starts `stride` apart."""
    starts = torch.arange(0, data.numel() - length + 1, stride)
    if limit and starts.numel() > limit:
        starts = starts[torch.linspace(0, starts.numel() - 1, limit).round().long()]
    return data[starts.to(data.device)[:, None] + torch.arange(length, device=data.device)]


# ---- model -----------------------------------------------------------------------------------

def make_config(args: argparse.Namespace, vocab_size: int, eot_id: int) -> ModelConfig:
    """The ModelConfig (HF DeepseekV3 field names) of the command-line sizes."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_dim,
        qk_rope_head_dim=args.qk_rope_dim, v_head_dim=args.v_dim,
        n_routed_experts=args.experts, num_experts_per_tok=2, n_shared_experts=1,
        n_group=args.n_group, topk_group=args.topk_group,
        routed_scaling_factor=args.routed_scaling_factor, norm_topk_prob=True,
        first_k_dense_replace=1, num_nextn_predict_layers=1,
        max_position_embeddings=max(args.max_positions, args.seq_len + 1),
        rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.02,
        bos_token_id=eot_id, eos_token_id=eot_id)


def stored_tensors(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors `save_checkpoint` writes (tied MTP embed/head aliases left out)."""
    params = model.state_dict(keep_vars=True)
    aliases = tied_aliases(model.config)
    return {n: t for n, t in params.items() if not (n in aliases and t is params[aliases[n]])}


def checkpoint_bytes(model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> tuple[int, int]:
    """(stored parameters, expected model.safetensors bytes) when saved in `dtype`
    (e_score_correction_bias stays float32)."""
    size = torch.finfo(dtype).bits // 8
    n, nbytes = 0, 0
    for name, t in stored_tensors(model).items():
        n += t.numel()
        nbytes += t.numel() * (4 if name.endswith("e_score_correction_bias") else size)
    return n, nbytes + 64 * len(stored_tensors(model))  # + the JSON header, roughly


def active_params(model: DeepseekV3ForCausalLM) -> int:
    """Stored parameters one token uses: all but the unchosen routed experts of each MoE layer
    (main and MTP), and but the MTP module itself for the main model's prediction."""
    c = model.config
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    mtp = sum(t.numel() for n, t in stored_tensors(model).items()
              if n.startswith(f"model.layers.{c.num_hidden_layers}."))
    n = sum(t.numel() for t in stored_tensors(model).values())
    return n - mtp - moe_layers * (c.n_routed_experts - c.num_experts_per_tok) * expert


def init_for_training(model: DeepseekV3ForCausalLM) -> None:
    """build_model's weights, with zero routing biases and the residual-branch output
    projections (o_proj, down_proj) scaled by 1/sqrt(2 * layers) (GPT-2), then trainable."""
    scale = (2 * (model.config.num_hidden_layers + 1)) ** -0.5
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                t.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                t.mul_(scale)
    model.train().requires_grad_(True)


# ---- training forward ------------------------------------------------------------------------

class WindowKvCache:
    """KvCache of B independent windows with no past: update() returns each window's slice of
    the latent just passed in (gradients flow; ContiguousKvCache detaches)."""

    def __init__(self, q_lens: Sequence[int]) -> None:
        self.q_lens = list(q_lens)

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        return list(latent.split(self.q_lens))


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(x, p, training=True) if p > 0 else x


def _attention(attn: MLAttention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               b: int, s: int) -> torch.Tensor:
    """MLAttention.forward for B whole windows at once: x [B*S, hidden] (normed) -> [B*S, hidden].

    Same weights and math as the engine (latent = kv_a_layernorm(c_kv) ++ rope(k_pe), keys and
    values expanded through kv_b_proj, causal softmax with softmax_scale), batched over windows.
    """
    c, t, h = attn.c, x.shape[0], attn.c.num_attention_heads
    nope, rope_d, vd = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    if c.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q_nope, q_pe = q.view(t, h, c.qk_head_dim).split([nope, rope_d], dim=-1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope_d], -1)
    cos, sin = rope
    q_pe = apply_rope(q_pe, cos, sin, c.rope_interleave)  # [T, H, rope]
    k_pe = apply_rope(k_pe[:, None, :], cos, sin, c.rope_interleave)  # [T, 1, rope]
    kv = F.linear(attn.kv_a_layernorm(c_kv), attn.kv_b_proj.weight).view(t, h, nope + vd)
    k_nope, v = kv.split([nope, vd], dim=-1)
    dt = v.dtype
    q = torch.cat((q_nope.to(dt), q_pe.to(dt)), -1)  # [T, H, qk_head_dim]
    k = torch.cat((k_nope, k_pe.to(dt).expand(t, h, rope_d)), -1)  # rope key shared by heads
    q, k, v = (z.view(b, s, h, -1).transpose(1, 2) for z in (q, k, v))  # [B, H, S, d]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.softmax_scale)
    return attn.o_proj(o.transpose(1, 2).reshape(t, h * vd))


def _moe(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE.forward without host syncs: x [T, hidden] -> ([T, hidden], expert loads [E]).

    Routing is the engine's `route` in float32; the routed experts run as one wide MLP over all
    tokens (width E * moe_intermediate) whose per-expert slice is scaled by the token's gate
    weight (0 for experts not chosen), which sums sum_e w_e * expert_e(x) like experts_forward.
    """
    c = moe.gate.c
    t, e = x.shape[0], c.n_routed_experts
    with torch.autocast(x.device.type, enabled=False):
        ids, weights = route(x.float(), moe.gate.weight, moe.gate.e_score_correction_bias, c)
    gates = torch.zeros(t, e, device=x.device).scatter(1, ids, weights)  # [T, E] float32
    w_gate = torch.cat([ex.gate_proj.weight for ex in moe.experts])  # [E * I, hidden]
    w_up = torch.cat([ex.up_proj.weight for ex in moe.experts])  # [E * I, hidden]
    w_down = torch.cat([ex.down_proj.weight for ex in moe.experts], dim=1)  # [hidden, E * I]
    hid = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)  # [T, E * I]
    hid = (hid.view(t, e, -1) * gates[:, :, None].to(hid.dtype)).view(t, -1)
    out = F.linear(hid, w_down)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    load = torch.zeros(e, device=x.device).index_add_(
        0, ids.flatten(), torch.ones(ids.numel(), device=x.device))
    return out, load


def _layer(layer: DecoderLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
           b: int, s: int, dropout: float, loads: list[torch.Tensor]) -> torch.Tensor:
    # x: [B*S, hidden] residual stream -> [B*S, hidden]; DecoderLayer.forward plus dropout
    x = x + _dropout(_attention(layer.self_attn, layer.input_layernorm(x), rope, b, s), dropout)
    h = layer.post_attention_layernorm(x)
    if isinstance(layer.mlp, MoE):
        m, load = _moe(layer.mlp, h)
        loads.append(load)
    else:
        m = layer.mlp(h)
    return x + _dropout(m, dropout)


def train_forward(model: DeepseekV3ForCausalLM, ids: torch.Tensor, next_ids: torch.Tensor,
                  dropout: float = 0.0, impl: str = "batched"
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Main and MTP hidden states of B windows.

    Args: ids [B, S] tokens at positions 0..S-1; next_ids [B, S] the tokens at 1..S.
    Returns: (final-normed main hidden [B*S, hidden] (feed `model.logits`), MTP module 0's
    hidden [B*S, hidden] (feed `model.mtp_logits(0, .)`), expert loads [E] per MoE layer
    (batched only)). impl "engine" runs `model(...)` and `model.mtp_forward` (no dropout).
    """
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).repeat(b)  # [B*S]
    if impl == "engine":
        q_lens = [s] * b
        kv = WindowKvCache(q_lens)
        hidden = model(ids.flatten(), positions, q_lens, kv)
        return hidden, model.mtp_forward(0, hidden, next_ids.flatten(), positions, q_lens, kv), []
    if impl != "batched":
        raise ValueError(f"impl={impl!r}: 'batched' or 'engine'")
    rope = model.rope(positions)
    loads: list[torch.Tensor] = []
    x = _dropout(model.model.embed_tokens(ids.flatten()), dropout)
    for i in range(model.config.num_hidden_layers):
        x = _layer(model.model.layers[i], x, rope, b, s, dropout, loads)
    hidden = model.model.norm(x)
    mtp = model.mtp_layer(0)  # mtp_forward's input, eq. 21 of the DeepSeek-V3 report
    e = mtp.enorm(mtp.embed_tokens(next_ids.flatten()))
    x = mtp.eh_proj(torch.cat((e, mtp.hnorm(hidden)), dim=-1))
    return hidden, _layer(mtp, x, rope, b, s, dropout, loads), loads


def losses(model: DeepseekV3ForCausalLM, windows: torch.Tensor, dropout: float = 0.0,
           impl: str = "batched") -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(main CE, MTP CE, loads) of windows [B, S + 2]: main predicts t+1, MTP t+2."""
    s = windows.shape[1] - 2
    ids, next_ids, next2 = windows[:, :s], windows[:, 1:s + 1], windows[:, 2:]
    hidden, mtp_hidden, loads = train_forward(model, ids, next_ids, dropout, impl)
    main = F.cross_entropy(model.logits(hidden), next_ids.flatten())
    mtp = F.cross_entropy(model.mtp_logits(0, mtp_hidden), next2.flatten())
    return main, mtp, loads


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, windows: torch.Tensor, batch: int,
             amp: contextlib.AbstractContextManager[Any] | None = None) -> tuple[float, float]:
    """Mean (main, MTP) validation cross-entropy over windows [n, S + 2] (no dropout)."""
    was_training = model.training
    model.eval()
    main = torch.zeros((), device=windows.device)
    mtp = torch.zeros((), device=windows.device)
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        with amp if amp is not None else contextlib.nullcontext():
            a, m, _ = losses(model, w)
        main += a.float() * w.shape[0]
        mtp += m.float() * w.shape[0]
    model.train(was_training)
    n = windows.shape[0]
    return main.item() / n, mtp.item() / n


@torch.no_grad()
def update_routing_bias(model: DeepseekV3ForCausalLM, loads: list[torch.Tensor],
                        speed: float) -> None:
    """Auxiliary-loss-free balancing: bias += speed * sign(mean load - load), per MoE layer
    (the main MoE layers, then the MTP module's, the order `train_forward` appends loads)."""
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    for moe, load in zip(moes, loads, strict=True):
        moe.gate.e_score_correction_bias.add_(speed * torch.sign(load.mean() - load))


def lr_at(step: int, peak: float, warmup: int, total: int, final_frac: float) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine to final_frac * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- output ----------------------------------------------------------------------------------

def copy_for_saving(model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> DeepseekV3ForCausalLM:
    """A CPU copy of the model's weights in `dtype` (MTP embed/head shared as in `model`)."""
    out = DeepseekV3ForCausalLM(model.config, dtype=dtype)
    out.share_mtp_weights()
    out.load_state_dict({n: t.detach().cpu() for n, t in model.state_dict().items()})
    return out.eval().requires_grad_(False)


def write_notes(out: Path, summary: dict[str, Any]) -> None:
    """README.md and LICENSE of the output folder."""
    (out / "LICENSE").write_text(
        "Training data: Tiny Shakespeare (karpathy/char-rnn data/tinyshakespeare/input.txt),\n"
        "concatenated works of William Shakespeare, which are in the public domain.\n\n"
        "The weights (model.safetensors), config.json and tokenizer.json in this folder were\n"
        "produced from that text by tools/train_small.py of the Tandem project and are\n"
        "distributed under the project's license, Apache License 2.0 (see the repository's\n"
        "LICENSE file).\n", encoding="utf-8")
    c = summary["config"]
    (out / "README.md").write_text(
        "# tandem-shakespeare (small DeepSeek-V3-architecture model)\n\n"
        "Trained by `tools/train_small.py` (Tandem) with the engine's own model code on Tiny\n"
        "Shakespeare (public domain; see LICENSE). Hugging Face layout: `config.json`,\n"
        f"`model.safetensors` ({summary['save_dtype']}), `tokenizer.json` (byte-level BPE,\n"
        f"{c['vocab_size']} ids, `{EOT}` = id {c['eos_token_id']} as bos/eos).\n\n"
        f"- layers {c['num_hidden_layers']} (1 dense, {c['num_hidden_layers'] - 1} MoE), hidden "
        f"{c['hidden_size']}, {c['n_routed_experts']} routed experts (top-2) + 1 shared, one "
        "MTP module\n"
        f"- stored parameters {summary['stored_params']:,}\n"
        f"- steps {summary['steps']}, tokens {summary['tokens']:,}, "
        f"{summary['elapsed_s']:.0f} s on {summary['device']}\n"
        f"- validation loss (main, nats/token) {summary['val_loss']:.4f} at step "
        f"{summary['saved_step']}; MTP module {summary['val_mtp_loss']:.4f}\n\n"
        "Command:\n\n```\n" + summary["command"] + "\n```\n\n"
        "`training_log.json` holds the curves; `python tools/plot_loss.py DIR` draws "
        "`loss_curve.png`.\n", encoding="utf-8")


def plot(out: Path) -> bool:
    """loss_curve.png from training_log.json; False when matplotlib is missing."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plot_loss import plot_log  # tools/plot_loss.py

    return plot_log(out / "training_log.json", out / "loss_curve.png")


# ---- the run ---------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--out", required=True, help="output folder (HF checkpoint layout)")
    a("--data", default=str(default_data()), help="training text file")
    a("--max-chars", type=int, default=0, help="use only the first N characters (0 = all)")
    a("--vocab-size", type=int, default=4096)
    a("--seq-len", type=int, default=256)
    a("--batch-size", type=int, default=64)
    a("--layers", type=int, default=6, help="main decoder layers (first dense, rest MoE)")
    a("--hidden", type=int, default=384)
    a("--heads", type=int, default=6)
    a("--q-lora-rank", type=int, default=160, help="0 = plain q_proj")
    a("--kv-lora-rank", type=int, default=128)
    a("--qk-nope-dim", type=int, default=64)
    a("--qk-rope-dim", type=int, default=32)
    a("--v-dim", type=int, default=64)
    a("--intermediate", type=int, default=1024, help="dense MLP width (layer 0)")
    a("--moe-intermediate", type=int, default=192, help="one expert's (and the shared) width")
    a("--experts", type=int, default=8, help="routed experts per MoE layer (top-2)")
    a("--n-group", type=int, default=4)
    a("--topk-group", type=int, default=2)
    a("--routed-scaling-factor", type=float, default=2.5)
    a("--max-positions", type=int, default=2048, help="config max_position_embeddings")
    a("--lr", type=float, default=1e-3, help="peak learning rate")
    a("--final-lr-frac", type=float, default=0.1)
    a("--warmup", type=int, default=-1, help="warm-up steps (-1 = 10 %% of the planned steps, "
      "or 100 when planned from the time budget)")
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0)
    a("--dropout", type=float, default=0.2)
    a("--mtp-weight", type=float, default=0.3)
    a("--bias-update", type=float, default=1e-3, help="routing-bias speed (0 = off)")
    a("--epochs", type=float, default=20.0, help="plan the schedule over this many passes "
      "over the training tokens (0 = plan from --max-minutes)")
    a("--steps", type=int, default=0, help="total steps (overrides --epochs)")
    a("--max-minutes", type=float, default=13.0, help="wall-clock budget from start-up: "
      "training stops and saves when it is reached, whatever the plan")
    a("--eval-every", type=int, default=0, help="steps between validations (0 = 1/25 of the "
      "planned steps, or 250 when planned from the time budget)")
    a("--eval-windows", type=int, default=0, help="validation windows (0 = all)")
    a("--log-every", type=int, default=25)
    a("--seed", type=int, default=1234)
    a("--device", default="auto")
    a("--impl", default="batched", choices=("batched", "engine"))
    a("--compile", action="store_true", help="torch.compile the loss (CUDA)")
    a("--save-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a("--save", default="best", choices=("best", "last"), help="which weights to save")
    a("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    a("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.layers < 3:
        p.error("--layers: need >= 3 (one dense layer, then at least 2 MoE layers)")
    if args.experts < 8:
        p.error("--experts: need >= 8")
    if args.seq_len < 8:
        p.error("--seq-len: need >= 8")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, save the checkpoint folder, return the summary (also in training_log.json)."""
    t0 = time.time()
    budget_s = args.max_minutes * 60.0
    say = (lambda *_: None) if args.quiet else (lambda *m: print(*m, flush=True))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto"
                          else "cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    text = read_text(args.data)
    if args.max_chars:
        text = text[:args.max_chars]
    train_text, val_text = split_text(text)
    tok = train_tokenizer(train_text, args.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    train_ids, val_ids = encode(tok, train_text).to(device), encode(tok, val_text).to(device)
    s = args.seq_len
    if val_ids.numel() < s + 2 or train_ids.numel() < s + 2:
        raise SystemExit(f"--seq-len {s}: the text is too short ({train_ids.numel()} train, "
                         f"{val_ids.numel()} validation tokens)")
    val = val_windows(val_ids, s + 2, s, args.eval_windows)
    config = make_config(args, tok.get_vocab_size(with_added_tokens=True), eot)
    model = build_model(config, seed=args.seed, device=device)
    init_for_training(model)
    save_dtype = getattr(torch, args.save_dtype)
    n_stored, n_bytes = checkpoint_bytes(model, save_dtype)
    say(f"data: {len(train_text):,} + {len(val_text):,} chars -> {train_ids.numel():,} train + "
        f"{val_ids.numel():,} validation tokens ({len(train_text) / train_ids.numel():.2f} "
        f"chars/token), {val.shape[0]} validation windows; tokenizer {config.vocab_size} ids")
    say(f"model: {n_stored:,} stored parameters ({active_params(model):,} active per token in "
        f"the main model), checkpoint ~{n_bytes / 1e6:.1f} MB as {args.save_dtype}; "
        f"device {device}")

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda or None)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext())
    loss_fn = losses
    if args.compile and cuda:
        loss_fn = torch.compile(losses)  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * s
    total = args.steps or math.ceil(args.epochs * train_ids.numel() / tokens_per_step)
    plan_at = -1 if total else 30  # neither --steps nor --epochs: plan from the time budget
    total = total or 10**9
    warmup = args.warmup if args.warmup >= 0 else (100 if plan_at > 0 else
                                                   max(1, round(0.1 * total)))
    eval_every = args.eval_every or (250 if plan_at > 0 else max(1, total // 25))
    if plan_at < 0:
        say(f"plan: {total} steps of {tokens_per_step:,} tokens "
            f"({total * tokens_per_step / train_ids.numel():.1f} epochs), warm-up {warmup}")
    log: list[dict[str, Any]] = []
    best: dict[str, Any] = {"val_loss": math.inf}
    best_state: dict[str, torch.Tensor] | None = None
    bar = _progress(args.quiet)
    run_loss = torch.zeros((), device=device)
    run_mtp = torch.zeros((), device=device)
    run_n, t_mark, step_mark = 0, time.time(), 0
    t_train = time.time()
    step = 0

    def do_eval(step: int) -> None:
        nonlocal best, best_state
        vl, vm = evaluate(model, val, args.batch_size, amp)
        if vl < best["val_loss"]:
            best = {"step": step, "val_loss": vl, "val_mtp_loss": vm}
            best_state = {n: t.detach().clone() for n, t in model.state_dict().items()}
        log.append({"step": step, "val_loss": vl, "val_mtp_loss": vm,
                    "elapsed_s": round(time.time() - t0, 2)})
        bar.note(f"step {step}: val {vl:.4f} (mtp {vm:.4f}), best {best['val_loss']:.4f} "
                 f"at {best['step']}")

    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.manual_seed(args.seed)  # dropout masks: seeded here, global state restored after
        while step < total:
            lr = lr_at(step, args.lr, warmup, total, args.final_lr_frac)
            for g in opt.param_groups:
                g["lr"] = lr
            windows = sample_windows(train_ids, args.batch_size, s + 2, gen)
            with amp:
                main, mtp, loads = loss_fn(model, windows, args.dropout, args.impl)
                loss = main + args.mtp_weight * mtp
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.bias_update and loads:
                update_routing_bias(model, loads, args.bias_update)
            step += 1
            run_loss += main.detach()
            run_mtp += mtp.detach()
            run_n += 1
            if step % args.log_every == 0 or step == total or step == plan_at:
                tl, tm = run_loss.item() / run_n, run_mtp.item() / run_n
                now = time.time()
                tps = (step - step_mark) * tokens_per_step / max(now - t_mark, 1e-9)
                log.append({"step": step, "train_loss": round(tl, 5), "train_mtp_loss":
                            round(tm, 5), "lr": lr, "elapsed_s": round(now - t0, 2),
                            "tokens_per_s": round(tps)})
                bar.update(step, total, f"loss {tl:.3f} mtp {tm:.3f} val "
                           f"{best['val_loss']:.3f} lr {lr:.2e} {tps / 1e3:.0f}k tok/s")
                run_loss.zero_()
                run_mtp.zero_()
                run_n, t_mark, step_mark = 0, now, step
            if step % eval_every == 0 or step == total:
                do_eval(step)
            if step == plan_at:  # plan the cosine over the steps the time budget allows
                t_eval = time.time()
                do_eval(step)
                t_eval = time.time() - t_eval
                per_step = (time.time() - t_train - t_eval) / step  # incl. warm-up: a bit long
                per_step += t_eval / eval_every
                left = budget_s - RESERVE_S - (time.time() - t0)
                total = max(step + 1, step + int(left / per_step))
                bar.note(f"planned {total} steps ({per_step * 1e3:.1f} ms/step with "
                         f"evaluations, {tokens_per_step / per_step / 1e3:.0f}k tok/s)")
            if time.time() - t0 > budget_s - RESERVE_S:
                bar.note(f"time budget reached at step {step} of {total}")
                if log[-1].get("val_loss") is None or log[-1]["step"] != step:
                    do_eval(step)
                break
    bar.close()
    train_s = time.time() - t_train

    if args.save == "best" and best_state is not None:
        model.load_state_dict(best_state)
        saved_step = best["step"]
    else:
        saved_step = step
    saved = copy_for_saving(model, save_dtype)
    save_checkpoint(saved, config, out)
    # what a float32 engine gets from the saved file: evaluate the rounded weights in float32
    check = copy_for_saving(saved, torch.float32).to(device)
    vl, vm = evaluate(check, val, args.batch_size)
    summary = {
        "command": args.command,
        "args": vars(args), "config": config.to_hf_dict(), "device": str(
            torch.cuda.get_device_name(device) if cuda else "cpu"),
        "stored_params": n_stored, "checkpoint_bytes": (out / WEIGHTS_FILE).stat().st_size,
        "save_dtype": args.save_dtype, "steps": step, "tokens": step * tokens_per_step,
        "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(),
        "epochs": step * tokens_per_step / train_ids.numel(),
        "train_s": round(train_s, 1), "elapsed_s": round(time.time() - t0, 1),
        "saved_step": saved_step, "best": best,
        "val_loss": vl, "val_mtp_loss": vm,  # of the saved weights, evaluated in float32
        "log": log,
    }
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n",
                                           encoding="utf-8")
    write_notes(out, summary)
    plotted = plot(out)
    say(f"saved {out} ({CONFIG_FILE}, {WEIGHTS_FILE} {summary['checkpoint_bytes'] / 1e6:.1f} MB "
        f"{args.save_dtype}, tokenizer.json, training_log.json"
        f"{', loss_curve.png' if plotted else '; no matplotlib: no loss_curve.png'}): "
        f"step {saved_step}, val loss {vl:.4f} (mtp {vm:.4f}) in float32; {step} steps, "
        f"{summary['epochs']:.1f} epochs, {summary['elapsed_s']:.0f} s")
    return summary


class _progress:
    """tqdm when importable, else a plain line per update."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.bar = None
        if not quiet:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=None, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, total: int, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            if total < 10**9 and self.bar.total != total:
                self.bar.total = total
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(f"step {step}/{total if total < 10**9 else '?'} {text}", flush=True)

    def note(self, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.command = "python tools/train_small.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":
    main()
