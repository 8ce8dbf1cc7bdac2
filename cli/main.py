"""The `tandem` command: one subcommand per process, plus `up`, `generate` and `demo`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from cli.flags import add_flags, build
from common.env import env_default, env_name


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s",
                        stream=sys.stderr)


def _router(args: argparse.Namespace) -> int:
    from router.main import RouterOptions, run
    asyncio.run(run(build(RouterOptions, args)))
    return 0


def _worker(args: argparse.Namespace) -> int:
    from engine.worker_host import WorkerOptions
    if args.command == "prefill":
        from prefill_worker.main import run
    else:
        from decode_worker.main import run
    asyncio.run(run(build(WorkerOptions, args)))
    return 0


def _up(args: argparse.Namespace) -> int:
    from cli.cluster import LocalCluster

    async def main() -> None:
        cluster = LocalCluster(model=args.model, num_prefill=args.prefill, num_decode=args.decode, etcd=args.etcd,
                               router_port=args.port, router_args=["--router-mode", args.router_mode],
                               num_mocker=args.mocker)
        await cluster.start()
        print(f"tandem up: router at {cluster.router_address}, etcd at {cluster.etcd_endpoint}, "
              f"logs in {cluster.log_dir}; Ctrl-C stops everything", flush=True)
        stop = asyncio.Event()
        from common.lifecycle import install_stop_signals
        install_stop_signals(stop, on_second=cluster.kill)
        try:
            await stop.wait()
        finally:
            print("stopping ...", flush=True)
            await cluster.stop()

    asyncio.run(main())
    return 0


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from cli.client import frontend_stub, generate

    async def main() -> int:
        ch, stub = frontend_stub(args.router)
        try:
            c = await generate(stub, text=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                               seed=args.seed, stop=args.stop, on_text=lambda t: print(t, end="", flush=True))
        except grpc.aio.AioRpcError as exc:
            print(f"tandem generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        finally:
            await ch.close()
        print(flush=True)
        print(f"[{len(c.token_ids)} tokens, finish={c.finish_reason}, ttft={c.ttft_s * 1000:.0f} ms]",
              file=sys.stderr)
        return 0

    return asyncio.run(main())


def _explain(args: argparse.Namespace) -> int:
    import grpc

    from cli.client import frontend_stub
    from common.pb.tandem.v1 import frontend_pb2

    async def main() -> int:
        ch, stub = frontend_stub(args.router)
        try:
            resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(text=args.prompt), timeout=10)
        except grpc.aio.AioRpcError as exc:
            print(f"tandem explain: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        finally:
            await ch.close()
        print(resp.text)
        return 0

    return asyncio.run(main())


def _arg(p: argparse.ArgumentParser, flag: str, default, help: str, env: bool = True, kind=None) -> None:
    kind = kind or (type(default) if default is not None else str)
    if env:
        p.add_argument(flag, type=kind, default=env_default(flag, default, kind),
                       help=f"{help} (default {default!r}; env {env_name(flag)})")
    else:
        p.add_argument(flag, type=kind, default=default, help=f"{help} (default {default!r})")


def main(argv: list[str] | None = None) -> int:
    from bench.main import add_parser as add_bench
    from engine.worker_host import WorkerOptions
    from mocker.main import add_parser as add_mocker
    from router.main import RouterOptions

    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    parser.add_argument("--log-level", default=env_default("--log-level", "info"), help="env TANDEM_LOG_LEVEL")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("router", help="the client-facing gRPC router")
    add_flags(p, RouterOptions)
    p.set_defaults(func=_router)
    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"a {role} worker")
        add_flags(p, WorkerOptions)
        p.set_defaults(func=_worker)
    add_mocker(sub)
    add_bench(sub)
    p = sub.add_parser("up", help="a local cluster: etcd, router, prefill and decode workers")
    _arg(p, "--model", "tandem-shakespeare", "served model: 'tandem-shakespeare' (shipped, trained), 'tandem-tiny' (seeded) or a checkpoint folder")
    _arg(p, "--etcd", "", "use this etcd (host:port) instead of starting one")
    _arg(p, "--port", 50051, "router port")
    _arg(p, "--prefill", 1, "prefill workers", env=False)
    _arg(p, "--decode", 1, "decode workers", env=False)
    _arg(p, "--router-mode", "kv", "kv | approx | round-robin | random | least-loaded")
    _arg(p, "--mocker", 0, "simulated workers instead of real ones (tandem mocker; model tandem-mock)", env=False)
    p.set_defaults(func=_up)
    p = sub.add_parser("generate", help="send one prompt to a router and stream the answer")
    p.add_argument("prompt", help="prompt text")
    _arg(p, "--router", "127.0.0.1:50051", "router address host:port")
    _arg(p, "--max-tokens", 64, "tokens to generate", env=False)
    _arg(p, "--temperature", 0.0, "0 = greedy", env=False)
    _arg(p, "--seed", None, "sampling seed (with --temperature > 0)", env=False, kind=int)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.set_defaults(func=_generate)
    p = sub.add_parser("explain", help="show where the router would place a prompt, and why")
    p.add_argument("prompt", help="prompt text")
    _arg(p, "--router", "127.0.0.1:50051", "router address host:port")
    p.set_defaults(func=_explain)
    p = sub.add_parser("demo", help="the README demo: MT-Bench through a local cluster, checked against the reference",
                       add_help=False)
    p.set_defaults(func=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from cli.demo import main as demo_main
        return demo_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    _logging(args.log_level)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:  # start-up failures: one line, no traceback
        logging.getLogger("tandem").debug("start-up failed", exc_info=True)
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
