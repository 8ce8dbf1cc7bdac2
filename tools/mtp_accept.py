"""MTP accept length of a trained checkpoint on held-out text (greedy, k = 1..K drafts).

Usage: python tools/mtp_accept.py CHECKPOINT_DIR [--k 3] [--positions 2000] [--device cuda]
                                  [--json out.json]

At each position t of the validation split (the last 10 % of the training text, as
tools/train_small.py splits it; teacher-forced context x[0..t]):
- the target: the main model's greedy continuation T1..T(K+1) from x[0..t];
- the drafts: DeepSeek/SGLang chain the single MTP module: draft 1 from the main hidden at t
  and T1 (at position t), draft i+1 from module's hidden of draft i and draft i's token (at
  position t+i). The MTP module's KV rows before t hold (main hidden at p, x[p+1]), the pairs
  a speculative decoder would have cached for the accepted text;
- accept length for k drafts = 1 + the number of leading drafts equal to T2..T(k+1).
The mean over positions is printed per k and written as JSON. Slow but plain: cached
single-token forwards on the engine's model (float32), one position at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.model import DeepseekV3ForCausalLM  # noqa: E402
from engine.model_source import load_model  # noqa: E402
from train_small import default_data, read_text, split_text  # noqa: E402  (tools/train_small.py)


class RecordingKv:
    """KvCache of one sequence that keeps every layer's latents (like ContiguousKvCache, but
    the rows stay readable so that forks can start from any prefix)."""

    def __init__(self) -> None:
        self.layers: dict[int, torch.Tensor] = {}

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        past = self.layers.get(layer)
        self.layers[layer] = latent if past is None else torch.cat((past, latent))
        return [self.layers[layer]]


class ForkKv:
    """KvCache of one sequence: the first prefix[layer] rows of a RecordingKv, then its own."""

    def __init__(self, base: RecordingKv, prefix: dict[int, int]) -> None:
        self.base, self.prefix = base, prefix
        self.own: dict[int, torch.Tensor] = {}

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        own = self.own.get(layer)
        self.own[layer] = latent if own is None else torch.cat((own, latent))
        return [torch.cat((self.base.layers[layer][:self.prefix[layer]], self.own[layer]))]


def _one(x: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.long, device=device)


@torch.inference_mode()
def prefill_window(model: DeepseekV3ForCausalLM, ids: torch.Tensor
                   ) -> tuple[RecordingKv, torch.Tensor, torch.Tensor]:
    """One plain forward over the window ids [W]: (its KV, final-normed hidden [W, hidden],
    greedy next tokens [W]); the MTP KV rows p < W-1 hold (hidden at p, ids[p+1]), the pairs a
    speculative decoder caches for accepted text."""
    w = ids.numel()
    kv = RecordingKv()
    positions = torch.arange(w, device=ids.device)
    hidden = model(ids, positions, [w], kv)
    model.mtp_forward(0, hidden[:-1], ids[1:], positions[:-1], [w - 1], kv)
    return kv, hidden, model.logits(hidden).argmax(-1)


@torch.inference_mode()
def targets_and_drafts(model: DeepseekV3ForCausalLM, kv: RecordingKv, hidden: torch.Tensor,
                       greedy: torch.Tensor, t: int, k_max: int) -> tuple[list[int], list[int]]:
    """At position t of a prefilled window: (the target's greedy T1..T(k_max+1) after
    ids[0..t], the chained MTP drafts D1..D(k_max) for the tokens after T1)."""
    n_layers, dev = model.config.num_hidden_layers, hidden.device
    fork = ForkKv(kv, {**{i: t + 1 for i in range(n_layers)}, n_layers: t})
    targets = [int(greedy[t])]  # T1
    for j in range(1, k_max + 1):  # T(j+1): greedy after ids[0..t] + T1..Tj
        h = model(_one(targets[-1], dev), _one(t + j, dev), [1], fork)
        targets.append(int(model.logits(h)[0].argmax()))
    drafts: list[int] = []
    prev, token = hidden[t:t + 1], targets[0]
    for i in range(k_max):  # draft i+1 from (prev, token) at position t+i
        prev = model.mtp_forward(0, prev, _one(token, dev), _one(t + i, dev), [1], fork)
        token = int(model.mtp_logits(0, prev)[0].argmax())
        drafts.append(token)
    return targets, drafts


def window_accepts(model: DeepseekV3ForCausalLM, ids: torch.Tensor, k_max: int,
                   first: int) -> list[int]:
    """For each position t in [first, W - k_max): the number of leading drafts (of k_max) that
    equal the target's T2..T(k_max+1); ids [W] is the window (every position used is < W)."""
    kv, hidden, greedy = prefill_window(model, ids)
    out = []
    for t in range(first, ids.numel() - k_max):
        targets, drafts = targets_and_drafts(model, kv, hidden, greedy, t, k_max)
        matched = 0
        while matched < k_max and drafts[matched] == targets[matched + 1]:
            matched += 1
        out.append(matched)
    return out


def measure(model: DeepseekV3ForCausalLM, ids: torch.Tensor, k_max: int, positions: int,
            window: int, first: int = 8) -> dict[str, Any]:
    """Accept lengths over up to `positions` positions of ids [N], in windows of `window`
    tokens spread evenly over ids. Returns {"accept_length": {k: mean}, ...}."""
    if window < first + k_max + 1:
        raise ValueError(f"window={window}: must be >= {first + k_max + 1}")
    per_window = window - k_max - first
    n_windows = max(1, min(-(-positions // per_window), ids.numel() // window))
    starts = torch.linspace(0, ids.numel() - window, n_windows).long().tolist()
    matched: list[int] = []
    for s in starts:
        matched += window_accepts(model, ids[s:s + window], k_max, first)
        if len(matched) >= positions:
            break
    matched = matched[:positions]
    accept = {k: 1 + sum(min(m, k) for m in matched) / len(matched) for k in range(1, k_max + 1)}
    first_ok = sum(m >= 1 for m in matched) / len(matched)
    return {"accept_length": accept, "positions": len(matched), "windows": len(starts),
            "window": window, "draft1_acceptance": first_ok}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="folder with config.json, model.safetensors, tokenizer.json")
    p.add_argument("--data", default=str(default_data()), help="the training text file")
    p.add_argument("--max-chars", type=int, default=0, help="as train_small.py --max-chars")
    p.add_argument("--k", type=int, default=3, help="largest number of draft tokens")
    p.add_argument("--positions", type=int, default=2000)
    p.add_argument("--window", type=int, default=256, help="tokens per context window "
                   "(<= the training --seq-len)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", default="", help="also write the result here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = read_text(args.data, "tools/mtp_accept.py")  # before loading: a missing file fails at once
    loaded = load_model(args.checkpoint)
    model = loaded.model.to(args.device)
    if model.config.num_nextn_predict_layers < 1:
        raise SystemExit(f"{args.checkpoint}: the checkpoint has no MTP module")
    if args.max_chars:
        text = text[:args.max_chars]
    ids = torch.tensor(loaded.tokenizer().encode(split_text(text)[1]), device=args.device)
    window = min(args.window, ids.numel(), model.config.max_position_embeddings)
    result = measure(model, ids, args.k, args.positions, window)
    result["checkpoint"] = str(args.checkpoint)
    for k, v in result["accept_length"].items():
        print(f"k={k}: mean accept length {v:.3f} (of at most {k + 1}) over "
              f"{result['positions']} positions")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
