"""`tandem tokenize`: a model's token ids for a text, as `logit_bias` users need them.

The HTTP and gRPC APIs take token ids in `logit_bias` ({"token id": bias}); this prints the ids
the model's own tokenizer gives a text (the one a router serving that model uses:
`tokenizer.json` of its checkpoint folder), one row per token with the token as logprobs list
it, then the ids as a JSON list, or with --bias B a JSON `logit_bias` object giving each of them
B. A word's id usually differs with a leading space (" love" against "love").

Which model: --model, TANDEM_MODEL, or `model` in the config file's [tokenize] or [worker] table
or top level; where none is set, the model the router at --router serves (its ListModels
answer: a cluster started with `tandem up --model tandem-tiny` tokenizes as tandem-tiny, not as
the workers' default), and only where no router answers, the workers' default model, said on
stderr. The router's name must be one this machine can load (a shipped name or a checkpoint
folder here); where it is not, this refuses and asks for --model rather than guess.
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
    model, note = (args.model, "") if args.model is not None else served_model(args)
    if model is None:
        print(f"tandem tokenize: {note}", file=sys.stderr)
        return 2
    try:
        name, _, ckpt = load_config(model)
    except (FileNotFoundError, ValueError) as exc:
        fix = f" ({note}); pass --model, the checkpoint folder" if "serves" in note else ""  # (the router's name)
        print(f"tandem tokenize: {exc}{fix}", file=sys.stderr)
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
    print(f"# {name}{f' ({note})' if note else ''}: {len(ids)} tokens of {args.text!r}", file=sys.stderr)
    for i in ids:
        print(f"{i:>8}  {tok.token_shown(i)!r}", file=sys.stderr)
    print(json.dumps({str(i): args.bias for i in dict.fromkeys(ids)} if args.bias is not None else ids))
    return 0


ASK_TIMEOUT_S = 3.0  # a router on this machine answers ListModels in milliseconds


def served_model(args: argparse.Namespace) -> tuple[str | None, str]:
    """(model to tokenize with, a note on where it came from) when --model is not set: the
    router's (ListModels at --router, with the client's TLS and API key options), or the workers'
    default where no router answers; (None, why) where the router answers with an error that a
    guess would hide (a refused key, a TLS failure)."""
    import asyncio

    import grpc

    from cli.client import client_credentials, frontend_stub, no_router_hint
    from common.pb.tandem.v1 import frontend_pb2

    async def ask() -> frontend_pb2.ListModelsResponse:
        ch, stub = frontend_stub(args.router, creds, args.api_key)
        try:
            return await stub.ListModels(frontend_pb2.ListModelsRequest(), timeout=ASK_TIMEOUT_S)
        finally:
            await ch.close()
    creds = client_credentials(args)
    try:
        models = asyncio.run(ask()).models
    except grpc.aio.AioRpcError as exc:
        details = (exc.details() or "").lower()
        # the default only where nothing listens (or nothing answers in time): a router that
        # answered with a TLS failure or a refusal is one whose model a guess would get wrong
        if (exc.code() == grpc.StatusCode.UNAVAILABLE and "refused" in details) \
                or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return WORKERS_DEFAULT_MODEL, (f"no router answered at {args.router}: the workers' default model; "
                                           "pass --model for another")
        hint = no_router_hint(exc, args.router, creds is not None)
        fix = ("pass --api-key (or TANDEM_API_KEY), or --model" if exc.code() == grpc.StatusCode.UNAUTHENTICATED
               else "or pass --model" if hint else "pass --model")
        return None, (f"the router at {args.router} did not say which model it serves: {exc.code().name}: "
                      f"{exc.details()}{hint}; {fix}")
    if not models:
        return WORKERS_DEFAULT_MODEL, f"the router at {args.router} named no model: the workers' default model"
    return models[0].name, f"the model the router at {args.router} serves"


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `tokenize` subcommand to the `tandem` parser; returns its parser (cli/main.py adds
    the router client's TLS and API key options)."""
    p = sub.add_parser("tokenize", help="a model's token ids for a text (for logit_bias): one row per token, "
                                        "then the ids as JSON")
    p.add_argument("text", help="the text (quote leading spaces: ' love')")
    add_option(p, "--model", None, "model name or checkpoint folder, as the workers' --model (default: the model "
               f"the router at --router serves; where none answers, {WORKERS_DEFAULT_MODEL})")
    add_option(p, "--router", "127.0.0.1:50051", "router asked which model it serves when --model is not set")
    p.add_argument("--bias", type=float, default=None,
                   help="print a logit_bias JSON object giving every token of the text this bias "
                        "(-100 all but bans them) instead of the id list")
    p.set_defaults(func=main)
    return p
