"""`tandem mocker`: the subcommand (flags from MockerOptions, see mocker/fleet.py)."""

from __future__ import annotations

import argparse
import asyncio


def add_parser(sub) -> None:
    from cli.flags import add_flags
    from mocker.fleet import MockerOptions

    p = sub.add_parser("mocker", help="simulated workers (real block pool, KV events, timing model; no model)")
    add_flags(p, MockerOptions, help={
        "model": "the served model's name and limits: tandem-mock (shipped config) or a folder with a config.json; "
                 "no weights are loaded",
        "num_blocks": "KV pool capacity of each simulated worker, in blocks",
        "chunk_size": "prefill chunk size of each simulated worker, in tokens (one chunk per simulated step, "
                      "first come first served); alias --chunked-prefill-size"})
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from cli.flags import build
    from common.tls import set_tls
    from mocker.fleet import MockerOptions, run

    opts = build(MockerOptions, args)
    set_tls(opts.tls)
    asyncio.run(run(opts))
    return 0
