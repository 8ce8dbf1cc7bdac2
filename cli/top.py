"""`tandem top`: a live terminal view of the cluster as the router sees it.

One `FrontendService.ClusterStatus` call per refresh (router/status.py): every worker with its
role, discovery state, health, the router's load on it (in-flight requests; active decode
blocks or queued prefill tokens), KV capacity and how much of it the router's KV index holds,
requests routed to it and their predicted prefix hit rate. With router replicas, a caption names
the model's other routers (each counts only its own requests' load). `--once` prints one table and exits
(for scripts and tests); on a terminal a rich Live table refreshes every `--interval` seconds
until `q` (or Ctrl-C); when stdout is not a terminal (a pipe, a file) a new table is printed
every `--interval` seconds instead, as `top -b` does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from cli.flags import add_option
from common.pb.tandem.v1 import frontend_pb2 as pb


def add_parser(sub):
    """Register `tandem top` on the CLI's subparsers; returns its parser (cli/main.py adds the
    client TLS options and --api-key of every client of the router)."""
    p = sub.add_parser("top", help="live view of the cluster from the router: workers, health, load, KV, hit rate "
                                   "(q quits)")
    add_option(p, "--router", "127.0.0.1:50051", "router address host:port")
    add_option(p, "--interval", 1.0, "seconds between refreshes", env="TANDEM_TOP_INTERVAL")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.set_defaults(func=main)
    return p


def _quit_on_q(stop: asyncio.Event):
    """On a terminal stdin: read keys unbuffered and set `stop` on q; returns the undo."""
    import os
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    loop = asyncio.get_running_loop()

    def on_key() -> None:
        if os.read(fd, 1) in (b"q", b"Q", b""):
            stop.set()
    loop.add_reader(fd, on_key)

    def undo() -> None:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    return undo


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until stop; True when stopped."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except (TimeoutError, asyncio.TimeoutError):
        pass
    return stop.is_set()


async def fetch(stub, timeout_s: float = 5.0) -> pb.ClusterStatusResponse:
    return await stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=timeout_s)


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def render(status: pb.ClusterStatusResponse):
    """A rich Table of one ClusterStatusResponse."""
    from rich.table import Table

    title = (f"router {status.router_instance_id}  model {status.model}  mode {status.mode}  "
             f"running {status.running_requests}  migrations {status.migrations}")
    table = Table(title=title, title_justify="left")
    for col, justify in (("worker", "left"), ("role", "left"), ("state", "left"), ("health", "left"),
                         ("in flight", "right"), ("load", "right"), ("kv used", "right"), ("kv cached", "right"),
                         ("routed", "right"), ("hit rate", "right"), ("metrics", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for w in status.workers:
        load = f"{w.active_blocks} blk" if w.role == "decode" else f"{w.queued_prefill_tokens} tok"
        used = _pct(w.active_blocks, w.kv_capacity_blocks) if w.role == "decode" else "-"
        health = "[green]healthy[/]" if w.healthy else f"[red]unhealthy ({w.consecutive_failures})[/]"
        if w.refused:
            health = f"[red]refused: {w.refused}[/]"
        role = f"{w.role} (MTP k={w.speculative_num_steps})" if w.speculative_num_steps else w.role
        table.add_row(w.instance_id, role, w.state, health, str(w.in_flight_requests), load, used,
                      f"{w.indexed_blocks}/{w.kv_capacity_blocks}", str(w.routed_requests),
                      f"{100 * w.hit_rate:.0f}%" if w.routed_requests else "-", w.metrics_address or "-")
    notes = [] if status.workers else ["no workers in discovery"]
    if len(status.routers) > 1:  # replicas: the figures above are this router's share of the load
        others = [r for r in status.routers if r.instance_id != status.router_instance_id]
        notes.append(f"{len(status.routers)} routers; in flight and load count this one's requests only; others: "
                     + ", ".join(f"{r.instance_id} (metrics {r.metrics_address or '-'})" for r in others))
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


async def _run(args: argparse.Namespace) -> int:
    import grpc
    from rich.console import Console
    from rich.live import Live

    from cli.client import client_credentials, frontend_stub
    from cli.client import no_router_hint

    try:
        creds = client_credentials(args)  # a local `tandem up`'s CA is found as for the other clients
    except ValueError as exc:
        print(f"tandem top: {exc}", file=sys.stderr)
        return 2
    ch, stub = frontend_stub(args.router, creds, args.api_key)
    try:
        # A terminal's own width; otherwise (a pipe, a file, a test) wide enough for every column.
        console = Console() if sys.stdout.isatty() else Console(width=200)
        if args.once:
            console.print(render(await fetch(stub)))
            return 0
        stop = asyncio.Event()
        if not sys.stdout.isatty():  # no Live display off a terminal: one table per refresh
            while True:
                console.print(render(await fetch(stub)))
                sys.stdout.flush()
                if await _wait(stop, args.interval):
                    return 0
        undo = _quit_on_q(stop) if sys.stdin.isatty() else (lambda: None)
        try:
            with Live(render(await fetch(stub)), console=console, refresh_per_second=4, screen=False) as live:
                while not await _wait(stop, args.interval):
                    live.update(render(await fetch(stub)))
        finally:
            undo()
        return 0
    except grpc.aio.AioRpcError as exc:
        hint = no_router_hint(exc, args.router, creds is not None)
        print(f"tandem top: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    finally:
        await ch.close()


def main(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        print(f"tandem top: --interval must be > 0 seconds, got {args.interval}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0
