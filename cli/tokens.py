"""`tandem tokenize`: a model's token ids for a text, as `logit_bias` users need them.

The HTTP and gRPC APIs take token ids in `logit_bias` ({"token id": bias}); this prints the ids
the model's own tokenizer gives a text (the one a router serving that model uses:
`tokenizer.json` of its checkpoint folder; --model, TANDEM_MODEL, or `model` in the config
file's [tokenize] or [worker] table or top level), one row per token with the token as logprobs
list it, then the ids as a JSON list, or with --bias B a JSON `logit_bias` object giving each
of them B. A word's id usually differs with a leading space (" love" against "love").
"""

from __future__ import annotations

import argparse
import json
import sys

from cli.flags import add_option

# the workers' default --model (engine.model_source.DEFAULT_MODEL; not imported: it loads torch,
# which `tandem --help` must not)
WORKERS_DEFAULT_MODEL = "tandem-shakespeare"


def main(args: argparse.Namespace) -> int:
    from common.sampling_params import MAX_LOGIT_BIAS
    from common.tokenizer import load_tokenizer
    from engine.model_source import load_config  # (torch: not for `tandem --help`)
    try:
        name, _, ckpt = load_config(args.model)
    except (FileNotFoundError, ValueError) as exc:
        print(f"tandem tokenize: {exc}", file=sys.stderr)
        return 2
    try:
        args.text.encode()
    except UnicodeEncodeError:  # bytes that are no UTF-8 (the shell passed them through as surrogates)
        print("tandem tokenize: the text is not valid UTF-8", file=sys.stderr)
        return 2
    if args.bias is not None and not -100.0 <= args.bias <= 100.0:
        print(f"tandem tokenize: --bias must be in [-100, 100], got {args.bias}", file=sys.stderr)
        return 2
    tok = load_tokenizer(ckpt)
    ids = tok.encode(args.text)
    if args.bias is not None and len(set(ids)) > MAX_LOGIT_BIAS:
        print(f"tandem tokenize: the text has {len(set(ids))} distinct tokens; a logit_bias takes at most "
              f"{MAX_LOGIT_BIAS}: use a shorter text", file=sys.stderr)
        return 2
    print(f"# {name}: {len(ids)} tokens of {args.text!r}", file=sys.stderr)
    for i in ids:
        print(f"{i:>8}  {tok.token_shown(i)!r}", file=sys.stderr)
    print(json.dumps({str(i): args.bias for i in dict.fromkeys(ids)} if args.bias is not None else ids))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `tokenize` subcommand to the `tandem` parser."""
    p = sub.add_parser("tokenize", help="a model's token ids for a text (for logit_bias): one row per token, "
                                        "then the ids as JSON")
    p.add_argument("text", help="the text (quote leading spaces: ' love')")
    add_option(p, "--model", WORKERS_DEFAULT_MODEL, "model name or checkpoint folder, as the workers' --model")
    p.add_argument("--bias", type=float, default=None,
                   help="print a logit_bias JSON object giving every token of the text this bias "
                        "(-100 all but bans them) instead of the id list")
    p.set_defaults(func=main)
