"""The rough edges a newcomer met (issue 17), one test each: help texts and tools that point to
the project's own docs, `tandem --help` without torch, `tandem top` off a terminal and its `q`,
`config show --config FILE router`, the flags that were missing or mis-described, tools that
say what is missing instead of a traceback, `tandem generate` with no router, a taken
--http-port, and `python -m bench.compare`'s usage line and table."""

from __future__ import annotations

import os
import pty
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import InProcessCluster

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def tandem(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return subprocess.run([PY, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


@pytest.fixture(scope="module")
def router(etcd_server, tiny_model):
    """A router alone (ClusterStatus needs no worker)."""
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="cli-newcomer")
    c.router = c.start("router")
    yield c.router
    c.close()


def test_help_imports_neither_torch_nor_fastapi():
    code = ("import sys, time; t = time.perf_counter()\n"
            "from cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'fastapi' in sys.modules)")
    out = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    seconds, torch_loaded, fastapi_loaded = out.stdout.split()[-3:]
    assert (torch_loaded, fastapi_loaded) == ("False", "False"), out.stdout
    print(f"tandem --help in-process: {float(seconds) * 1000:.0f} ms")


def test_no_help_text_doc_or_code_points_to_design_md():
    from cli.config import subparsers
    from cli.main import build_parser

    parser = build_parser()
    texts = {"tandem --help": parser.format_help()}
    texts |= {f"tandem {name} --help": p.format_help() for name, p in subparsers(parser).items()}
    for tool in sorted((ROOT / "tools").glob("*.py")):
        texts[str(tool.relative_to(ROOT))] = tool.read_text().split('"""')[1] if '"""' in tool.read_text() else ""
    for doc in [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").rglob("*.md")),
                *sorted((ROOT / "proto").rglob("*.proto"))]:  # the protos are the API's reference
        texts[str(doc.relative_to(ROOT))] = doc.read_text()
    # and the code's comments and docstrings, which readers follow too (this file names it to check)
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for name in tracked:
        if name != "tests/test_cli_newcomer.py":
            texts[name] = (ROOT / name).read_text()
    assert [name for name, text in texts.items() if "DESIGN.md" in text] == []


def test_version_flag_prints_the_version_processes_report(capsys):
    from cli.main import main
    from common.version import VERSION

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"tandem {VERSION}"


def test_top_prints_tables_when_stdout_is_a_pipe(router):
    with subprocess.Popen([PY, "-m", "cli.main", "top", "--router", router.address, "--interval", "0.2"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            lines, deadline = [], time.monotonic() + 60
            while sum("router router-" in line for line in lines) < 2 and time.monotonic() < deadline:
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if ready:
                    lines.append(proc.stdout.readline())
            assert sum("router router-" in line for line in lines) >= 2, lines  # one table per refresh
        finally:
            proc.kill()


def test_top_quits_on_q(router):
    # a pty for the child's stdin/stdout, started with subprocess (exec in C right after fork):
    # pty.fork() runs Python in the child of a multi-threaded test process, which can crash there
    fd, slave = pty.openpty()
    proc = subprocess.Popen([PY, "-m", "cli.main", "top", "--router", router.address, "--interval", "0.2"],
                            cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + 60
    try:
        while b"router router-" not in out and time.monotonic() < deadline:
            if select.select([fd], [], [], 1.0)[0]:
                out += os.read(fd, 4096)
        assert b"router router-" in out, out
        os.write(fd, b"q")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                assert proc.returncode == 0
                return
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    os.read(fd, 4096)
                except OSError:
                    pass
        pytest.fail("tandem top did not quit on q")
    finally:
        proc.kill()
        proc.wait()
        os.close(fd)


def test_top_interval_has_a_variable_and_is_checked():
    assert "TANDEM_TOP_INTERVAL" in tandem("top", "--help").stdout
    r = tandem("top", "--interval", "0")
    assert r.returncode == 2 and "--interval must be > 0" in r.stderr


def test_config_show_with_config_file_then_subcommand(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text("[router]\nport = 50071\n")
    r = tandem("config", "show", "--config", str(cfg), "router")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^port = 50071 +# file .*router\.port$", r.stdout, re.M), r.stdout
    assert "[prefill]" not in r.stdout  # only the subcommand asked for


def test_readme_says_the_pool_default_as_it_is():
    from worker.host import WorkerOptions

    readme = (ROOT / "README.md").read_text()
    assert WorkerOptions().mem_fraction_static == 0 and WorkerOptions().num_blocks == 0
    assert "`--mem-fraction-static F` (default 0, off" in readme
    assert "sizes its own pool with\n`--mem-fraction-static 0.75`" not in readme


def test_flags_that_were_missing_or_misdescribed():
    gen = tandem("generate", "--help").stdout
    assert "--top-p" in gen and "TANDEM_TOP_P" in gen
    demo = tandem("demo", "--help").stdout
    assert "(default 8)" in demo and "(default 32)" in demo and "(default 0: all 80)" in demo
    mocker = tandem("mocker", "--help").stdout
    assert "mem-fraction-static" not in mocker and "tandem-shakespeare" not in mocker and "tandem-mock" in mocker
    router = tandem("router", "--help").stdout
    assert "--http-port" in router and "TANDEM_HTTP_PORT" in router
    up = tandem("up", "--help").stdout
    assert "--http-port" in up and "8000" in up


def test_generate_without_a_router_suggests_tandem_up():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    r = tandem("generate", "hello", "--router", f"127.0.0.1:{port}")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr and "`tandem up`" in r.stderr, r.stderr
    assert f"nothing listens at 127.0.0.1:{port}" in r.stderr and "--tls-ca" not in r.stderr, r.stderr
    assert "check the address given by --router" in r.stderr, r.stderr  # not "pass --router": it was passed


@pytest.mark.parametrize("tool, args", [("train_small.py", ["--out", "OUT"]),
                                        ("mtp_accept.py", ["tandem-shakespeare"])])
def test_tools_say_what_data_is_missing(tool, args, tmp_path):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = subprocess.run([PY, f"tools/{tool}", *args, "--data", str(tmp_path / "absent.txt")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no training text at" in r.stderr and "--data FILE" in r.stderr and "tinyshakespeare" in r.stderr


def test_taken_http_port_is_one_line_naming_the_flag(etcd_server):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        r = tandem("router", "--etcd", etcd_server.endpoint, "--namespace", "cli-taken", "--model", "tandem-tiny",
                   "--port", "0", "--http-port", str(taken.getsockname()[1]), timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert re.search(r"^tandem router: .*--http-port \d+: cannot listen on", r.stderr, re.M), r.stderr


def test_taken_grpc_port_is_one_line_naming_the_flag_and_tandem_up_shows_it(etcd_server, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        r = tandem("router", "--etcd", etcd_server.endpoint, "--namespace", "cli-taken-grpc", "--model", "tandem-tiny",
                   "--port", port, "--http-port", "-1", timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert re.search(rf"^tandem router: .*--port {port}: cannot listen on 127.0.0.1:{port}: .*in use", r.stderr,
                         re.M), r.stderr
        # tandem up names the flag before it starts anything, not only "see logs" seconds later
        up = tandem("up", "--model", "tandem-tiny", "--port", port, "--http-port", "-1", "--insecure", timeout=180)
        assert up.returncode == 1 and "Traceback" not in up.stderr
        assert re.search(rf"^tandem up: --port {port} is in use", up.stderr, re.M), up.stderr
        assert "logs in" not in up.stdout + up.stderr
        http = tandem("up", "--model", "tandem-tiny", "--port", "0", "--http-port", port, "--insecure", timeout=180)
    assert http.returncode == 1 and f"--http-port {port} is in use" in http.stderr, http.stderr
    assert "--http-port -1 turns the HTTP API off" in http.stderr


@pytest.mark.parametrize("args, said", [(["--port", "99999"], "--port must be 0 (any free port) or a TCP port"),
                                        (["--port", "-1"], "--port must be 0 (any free port) or a TCP port"),
                                        (["--model", "tandem-Shakespeare"], "no such built-in model or folder "
                                         "(built-in: tandem-shakespeare, tandem-tiny"),
                                        (["--model", "tandem-mock"], "no weights: it is served by simulated "
                                         "workers (add --mocker N)"),
                                        (["--log-dir", "README.md"], "--log-dir README.md: not a folder")])
def test_up_refuses_a_bad_port_or_model_before_starting_anything(args, said):
    # the OS took 99999 as 34463 and -1 as 65535; an unknown model stopped every worker seconds later
    r = tandem("up", *args, "--insecure", timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and said in r.stderr, r.stderr
    assert "logs in" not in r.stdout + r.stderr  # refused before any process started
    w = tandem("router", "--etcd", "127.0.0.1:1", "--port", "70000", timeout=60)
    assert w.returncode == 1 and "--port must be 0 (any free port)" in w.stderr, w.stderr


def test_mocker_refuses_ports_past_65535():
    # worker i listens on --port + i: 65530 with 8 workers ran into the OS's wrap-around
    r = tandem("mocker", "--port", "65530", "--num-workers", "8", timeout=60)
    assert r.returncode != 0 and "would need port 65537, past 65535" in r.stderr, r.stderr
    r = tandem("mocker", "--port", "70000", timeout=60)
    assert r.returncode != 0 and "--port must be 0 (any free port)" in r.stderr, r.stderr


def test_generate_errors_name_its_flags():
    from cli.client import flag_named
    assert flag_named("sampling.max_tokens: must be >= 1, got 0") == "--max-tokens: must be >= 1, got 0"
    assert flag_named("sampling.stop[1]: 300 characters; at most 256") == "--stop[1]: 300 characters; at most 256"
    assert flag_named("text: prompt is empty") == "prompt is empty"
    assert flag_named("no decode worker") == "no decode worker"  # not a field: unchanged
    assert flag_named("sampling.unknown: x") == "sampling.unknown: x"


def test_each_subcommands_help_opens_with_its_line():
    for sub, line in (("mocker", "Simulated workers (real block pool"), ("up", "A local cluster: etcd, router"),
                      ("health", "Check a server's grpc.health.v1 status")):
        assert line in tandem(sub, "--help").stdout, sub


def test_bench_compare_usage_and_header_first():
    r = subprocess.run([PY, "-m", "bench.compare", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("usage: python -m bench.compare")
    r = subprocess.run([PY, "-m", "bench.compare", "--num-requests", "20", "--modes", "kv,round-robin"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=True)
    rows = [line for line in r.stderr.splitlines() if line.startswith("|")]
    assert rows[0].startswith("| mode |") and rows[1].startswith("|---") and rows[2].startswith("| kv |"), r.stderr
    assert "python -m bench.compare" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("tool", ["tools/bench_decode.py", "tools/bench_serving_gpu.py", "tools/bench_moe_branches.py"])
def test_gpu_benchmarks_say_cuda_is_missing(tool, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run([PY, tool, "--device", "cuda", "--out", str(tmp_path / "x.json")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "--device cpu" in r.stderr, r.stderr[-500:]


def test_a_worker_out_of_gpu_memory_at_start_says_which_flag_to_lower():
    import argparse

    import torch

    from cli.main import start_up_error

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 704.00 MiB. GPU 0 has a total "
                                      "capacity of 79.18 GiB of which 375.62 MiB is free.")
    lines = start_up_error(argparse.Namespace(command="decode", mem_fraction_static=0.44), oom).splitlines()
    # torch's sizes first, then the line `tandem up` quotes when the worker exits (its log's last)
    assert lines[0] == f"tandem decode: {oom}"
    assert lines[-1].startswith("tandem decode: out of GPU memory while starting: --mem-fraction-static 0.44 ")
    assert "Lower --mem-fraction-static" in lines[-1] and len(lines) == 2
    lines = start_up_error(argparse.Namespace(command="prefill", mem_fraction_static=0.0), oom).splitlines()
    assert "(--num-blocks) come first" in lines[-1]
    # other failures, and other commands, print the error alone
    assert start_up_error(argparse.Namespace(command="decode"), ValueError("--port: bad")) == "tandem decode: --port: bad"
    assert start_up_error(argparse.Namespace(command="router"), oom) == f"tandem router: {oom}"


def test_up_refuses_worker_counts_it_cannot_start_and_passes_an_absolute_config(tmp_path, monkeypatch, capsys):
    import signal

    from cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel.toml").write_text('log_level = "info"\n')
    monkeypatch.setenv("TANDEM_CONFIG", "restored after the test")  # `up` sets it for its children
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # `up` installs its own
    try:
        for argv, message in ((["--decode", "-1"], "--decode must be >= 0, got -1"),
                              (["--prefill", "-1"], "--prefill must be >= 0, got -1"),
                              (["--mocker", "-1"], "--mocker must be >= 0, got -1"),
                              (["--decode", "0"], "--decode 0 leaves no decode worker")):
            assert main(["up", "--config", "rel.toml", "--log-dir", "logs", *argv]) == 1  # before anything starts
            assert message in capsys.readouterr().err
            # the children run in the repository root: they get the file's absolute path
            assert os.environ["TANDEM_CONFIG"] == str(tmp_path / "rel.toml")
        assert list((tmp_path / "logs").iterdir()) == []  # no empty run folder left in --log-dir
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_a_cuda_device_torch_cannot_use_is_named_by_its_flag():
    import torch

    from worker.host import WorkerOptions

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        with pytest.raises(ValueError, match=rf"--device cuda:{count}: this machine has {count} CUDA device"):
            WorkerOptions(device=f"cuda:{count}").torch_device()
    else:
        with pytest.raises(ValueError, match="--device cuda:7: this machine has no CUDA device torch can use"):
            WorkerOptions(device="cuda:7").torch_device()


def test_bench_refuses_an_out_it_could_not_write_before_it_runs(tmp_path):
    from bench.main import BenchOptions, run

    with pytest.raises(ValueError, match="--out .*: is a folder"):
        run(BenchOptions(out=str(tmp_path), router="127.0.0.1:1", router_wait_s=0))
    # a folder that is not there yet is made (README: --out /tmp/bench/mock.json), before the run
    with pytest.raises(RuntimeError, match="not ready"):
        run(BenchOptions(out=str(tmp_path / "new" / "r.json"), router="127.0.0.1:1", router_wait_s=0))
    assert (tmp_path / "new").is_dir()


def test_a_failed_start_leaves_no_folder_without_logs_and_no_ca_key(tmp_path):
    """No etcd on PATH: `tandem up` stops before any process logs; the folder it made (its CA's
    key among the files) goes with it instead of piling up with a private key in it."""
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PATH"] = str(Path(PY).parent)  # python, no etcd
    r = subprocess.run([PY, "-m", "cli.main", "up", "--log-dir", str(logs), "--port", "0", "--http-port", "-1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "etcd" in r.stderr, r.stderr
    assert list(logs.iterdir()) == [], list(logs.rglob("*"))
    assert "logs in" not in r.stderr  # no folder of logs to point at


def test_client_addresses_with_a_port_out_of_range_are_refused_by_flag(capsys):
    from cli.main import main

    for argv, said in ((["health", "127.0.0.1:117587"], "ADDRESS 127.0.0.1:117587"),
                       (["health", "--port", "-3"], "--port -3"),
                       (["generate", "ROMEO:", "--router", "127.0.0.1:99999"], "--router 127.0.0.1:99999")):
        assert main(argv) == 1
        assert f"{said}: the port must be in 1..65535" in capsys.readouterr().err


def test_more_bad_values_are_refused_by_flag(tmp_path, capsys):
    from cli.main import main

    for argv, said in ((["generate", "ROMEO:", "--seed", "-1", "--temperature", "1"], "--seed must be in 0..2^64-1"),
                       (["health", "--health-timeout", "-1"], "--health-timeout must be a finite number"),
                       (["health", "--health-timeout", "nan"], "--health-timeout must be a finite number")):
        assert main(argv) != 0, argv
        assert said in capsys.readouterr().err, argv
    with pytest.raises(SystemExit, match="--timeout must be > 0 seconds"):  # bench's options' own check
        main(["bench", "--timeout", "0"])
    # a table's name written as a top-level key says so (it suggested the same name)
    bad = tmp_path / "bad.toml"
    bad.write_text("up = 5\n")
    assert main(["config", "show", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'up' is a table of options: write [up]" in err and "did you mean" not in err



def test_an_error_about_a_flag_set_elsewhere_says_where_it_was_set(tmp_path):
    # TANDEM_HTTP_PORT=-5 said "--http-port must be ...", which no command line had given
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    r = subprocess.run([PY, "-m", "cli.main", "up", "--insecure"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**env, "TANDEM_HTTP_PORT": "-5"})
    assert r.returncode == 1 and "got -5 (--http-port came from the environment variable TANDEM_HTTP_PORT)" \
        in r.stderr, r.stderr
    cfg = tmp_path / "t.toml"
    cfg.write_text("http_port = -7\n")
    r = tandem("up", "--insecure", "--config", str(cfg))
    assert r.returncode == 1 and f"got -7 (--http-port came from http_port in the config file {cfg})" \
        in r.stderr, r.stderr
    r = tandem("up", "--insecure", "--config", str(cfg), "--http-port", "-3")  # the flag wins, and says nothing more
    assert r.returncode == 1 and r.stderr.rstrip().endswith("got -3"), r.stderr


def test_up_refuses_a_bad_worker_value_from_the_file_or_environment_before_starting(tmp_path):
    # the workers refused it only once etcd and the router were up, seconds later
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    r = subprocess.run([PY, "-m", "cli.main", "up", "--insecure"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**env, "TANDEM_MAX_RUNNING": "0"})
    assert r.returncode == 1 and "the prefill workers would refuse it: --max-running must be >= 1, got 0 " \
        "(--max-running came from the environment variable TANDEM_MAX_RUNNING)" in r.stderr, r.stderr
    cfg = tmp_path / "t.toml"
    cfg.write_text("[decode]\nstream_interval = 0\n")
    r = tandem("up", "--insecure", "--config", str(cfg), "--prefill", "0")
    assert r.returncode == 1 and "the decode workers would refuse it: --stream-interval must be >= 1 token" \
        in r.stderr and "decode.stream_interval in the config file" in r.stderr, r.stderr
    assert "logs in" not in r.stdout + r.stderr and "Traceback" not in r.stderr  # nothing started
    r = tandem("up", "--insecure", "--mocker", "2", "--prefill", "3")
    assert r.returncode == 1 and "--prefill and --decode count real workers" in r.stderr, r.stderr


def test_up_checks_its_processes_values_as_it_will_pass_them(monkeypatch, tmp_path):
    # tandem up gives every process --metrics-port 0 (with --metrics, the default): a variable the
    # workers never see is no reason to refuse; a router value is refused before anything starts
    from cli import config
    from cli.main import _check_process_values, build_parser

    def check(*argv: str) -> bool:
        parser = build_parser("up", full=True)
        args = parser.parse_args(["up", *argv])
        config.apply(parser, args)
        return _check_process_values(args)[:2]

    for k in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TANDEM_METRICS_PORT", "-2")
    assert check("--insecure") == (False, ())
    monkeypatch.delenv("TANDEM_METRICS_PORT")
    monkeypatch.setenv("TANDEM_HTTP_HOST", "127.0.0.2")
    assert check("--https") == (True, ("127.0.0.2",))  # the router's --https certificate names it
    # a router on every interface records the hostname's address (a pod's IP), and so does its HTTP
    # API: the certificate names that address (here a stand-in for the resolver's answer)
    monkeypatch.delenv("TANDEM_HTTP_HOST")
    monkeypatch.setenv("TANDEM_HOST", "0.0.0.0")
    monkeypatch.setattr("socket.gethostbyname", lambda name: "10.1.2.3")
    assert check("--https") == (True, ("10.1.2.3",))
    monkeypatch.delenv("TANDEM_HOST")
    # advertised where nothing listens (processes on loopback, registered at another address): the
    # cluster would wait for routers that never see their workers; refused, naming the variable
    monkeypatch.setenv("TANDEM_ADVERTISE_HOST", "192.0.2.2")
    with pytest.raises(ValueError, match=r"the router would not be reached: --advertise-host 192.0.2.2 with --host "
                                         r"127.0.0.1: it would listen on loopback only.*came from the environment "
                                         r"variable TANDEM_ADVERTISE_HOST"):
        check("--https")
    monkeypatch.setenv("TANDEM_HOST", "0.0.0.0")  # listening everywhere: reached at the advertised address
    assert check("--https") == (True, ("192.0.2.2",))
    monkeypatch.setenv("TANDEM_HOST", "[::]")  # bracketed IPv6: the certificate names bare addresses
    monkeypatch.setenv("TANDEM_ADVERTISE_HOST", "[2001:db8::5]")
    assert check("--https") == (True, ("2001:db8::5",))
    monkeypatch.setenv("TANDEM_HOST", "[::1]")
    monkeypatch.setenv("TANDEM_ADVERTISE_HOST", "::1")
    assert check("--https") == (True, ())  # loopback only: no name beyond the ones every certificate has
    monkeypatch.delenv("TANDEM_HOST")
    monkeypatch.delenv("TANDEM_ADVERTISE_HOST")
    # router replicas share a port tandem up picks when given 0: not refused for --reuse-port
    assert check("--mocker", "1", "--routers", "2", "--port", "0", "--http-port", "0") == (False, ())
    monkeypatch.setenv("TANDEM_HTTP_HOST", "127.0.0.2")
    # a relative file path: made absolute from a variable (the processes run in the repository
    # root), refused from the config file
    from common.certs import LocalCa
    LocalCa(tmp_path / "web").issue("api", ("router",))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TANDEM_HTTP_HOST")
    monkeypatch.setenv("TANDEM_HTTP_TLS_CERT", "web/api.pem")
    monkeypatch.setenv("TANDEM_HTTP_TLS_KEY", "web/api-key.pem")
    assert check("--mocker", "1") == (True, ())
    assert os.environ["TANDEM_HTTP_TLS_CERT"] == str(tmp_path / "web" / "api.pem")
    monkeypatch.delenv("TANDEM_HTTP_TLS_CERT")
    monkeypatch.delenv("TANDEM_HTTP_TLS_KEY")
    monkeypatch.setenv("TANDEM_PROFILE_DIR", "prof")  # a folder written to, not read: the same rule
    check()  # (a worker's option: real workers, not the mocker)
    assert os.environ["TANDEM_PROFILE_DIR"] == str(tmp_path / "prof")
    monkeypatch.delenv("TANDEM_PROFILE_DIR")
    cfg = tmp_path / "relative-path.toml"
    cfg.write_text('[router]\napi_keys = "keys.toml"\n')
    try:
        monkeypatch.setenv("TANDEM_CONFIG", str(cfg))  # as tandem up passes --config on
        with pytest.raises(ValueError, match=r"--api-keys keys.toml is a relative path.*give it as an absolute path "
                                             r"\(it came from router.api_keys in the config file"):
            check("--mocker", "1")
        assert check("--mocker", "1", "--api-keys", "/abs/keys.toml")  # tandem up passes its own: not read
    finally:
        monkeypatch.delenv("TANDEM_CONFIG")
    monkeypatch.setenv("TANDEM_HTTP_HOST", "127.0.0.1")
    with pytest.raises(ValueError, match=r"the router would refuse it: --http-host sets how the HTTP API listens.*"
                                         r"came from the environment variable TANDEM_HTTP_HOST"):
        check("--mocker", "1", "--http-port", "-1")


def test_a_failed_tls_handshake_is_one_line_without_grpcs_own_log(router, tmp_path):
    # gRPC's C core printed "I1206 ... ssl_transport_security.cc ... Handshake failed ..." first
    from common.certs import LocalCa
    ca = LocalCa(tmp_path).ca_path  # the router serves plaintext: any CA fails the handshake
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "GRPC_"))}
    r = subprocess.run([PY, "-m", "cli.main", "generate", "hi", "--router", router.address, "--max-tokens", "2",
                        "--tls-ca", str(ca)], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "the TLS handshake with" in r.stderr, r.stderr
    assert "ssl_transport_security" not in r.stderr and not re.search(r"^[IWE]\d{4} ", r.stderr, re.M), r.stderr


def test_a_command_started_with_sigint_ignored_still_stops_on_it():
    # a shell script's `tandem bench &` starts with SIGINT ignored; `kill -INT` did nothing.
    # The shell ignores SIGINT and execs the command, as a script's background job does; a
    # preexec_fn would run Python in a fork of this many-threaded test process, whose child
    # once died there unseen (Popen counts a child that dies before exec as started).
    import signal
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", PY, "-m", "cli.main", "bench", "--router", "127.0.0.1:1",
           "--router-wait", "120", "--num-requests", "1"]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            first = p.stderr.readline()
            assert "waiting for the router" in first, (first, p.communicate())  # past its imports, and waiting
            assert p.poll() is None, p.communicate()
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=20)
            assert p.returncode != 0 and "Traceback" not in err, err
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_up_names_tandem_variables_no_option_reads():
    from cli.main import _unknown_variables
    assert _unknown_variables(["TANDEM_HTTP_CERT", "TANDEM_NUM_BLOCKS", "TANDEM_CONFIG", "TANDEM_SAMPLING_SEED"]) == {
        "TANDEM_HTTP_CERT": "TANDEM_HTTP_CERT (did you mean TANDEM_HTTP_TLS_CERT?)"}


def test_up_given_a_flag_of_its_processes_says_how_to_pass_it():
    r = tandem("up", "--http-host", "127.0.0.2")
    assert r.returncode == 2 and "--http-host is an option of the processes tandem up starts: give it as " \
        "TANDEM_HTTP_HOST=VALUE, or as http_host under [router] in a --config file" in r.stderr, r.stderr
    r = tandem("up", "--namespace", "x")  # one tandem up sets for them itself
    assert r.returncode == 2 and "tandem up gives the processes it starts one of its own" in r.stderr, r.stderr


def test_a_record_nothing_answers_at_is_told_apart():
    import socket
    from common.grpc_server import unreachable_record
    assert unreachable_record("127.0.0.1", "192.0.2.2") and unreachable_record("::1", "router.invalid")
    assert unreachable_record("localhost", "[2001:db8::1]")
    # another loopback address is another listener's: nothing answers at 127.0.0.2 or ::1 for 127.0.0.1
    assert unreachable_record("127.0.0.1", "127.0.0.2") and unreachable_record("[::1]", "127.0.0.1")
    assert not unreachable_record("127.0.0.1", "")  # not advertised apart: its own host
    assert not unreachable_record("0.0.0.0", "192.0.2.2") and not unreachable_record("[::]", "192.0.2.2")
    assert not unreachable_record("127.0.0.1", "localhost") and not unreachable_record("[::1]", "::1")
    assert not unreachable_record("10.0.0.5", "router.invalid")  # a specific interface: a NAT may forward
    # a name is judged by what it resolves to here (a hostname mapped to 127.0.0.1 is reached)
    name = socket.gethostname()
    here = {info[4][0] for info in socket.getaddrinfo(name, None)}
    assert unreachable_record("127.0.0.1", name) == ("127.0.0.1" not in here)


def test_up_notes_an_https_api_on_every_interface_whose_certificate_names_loopback_only(monkeypatch):
    from cli import config
    from cli.main import _check_process_values, build_parser

    def note(*argv: str) -> bool:
        parser = build_parser("up", full=True)
        args = parser.parse_args(["up", *argv])
        config.apply(parser, args)
        return _check_process_values(args).loopback_names_only

    for k in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TANDEM_HTTP_HOST", "0.0.0.0")
    assert note("--https") and not note()  # (without --https the API is plain HTTP: no certificate)
    monkeypatch.setenv("TANDEM_HOST", "0.0.0.0")
    monkeypatch.setenv("TANDEM_ADVERTISE_HOST", "192.0.2.2")
    assert not note("--https")  # the certificate names the advertised address
    monkeypatch.delenv("TANDEM_HTTP_HOST")
    monkeypatch.delenv("TANDEM_HOST")
    monkeypatch.delenv("TANDEM_ADVERTISE_HOST")
    assert not note("--https")  # on loopback: loopback names are the right ones


def test_health_where_nothing_listens_says_so_not_tls():
    import socket
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = tandem("health", f"127.0.0.1:{port}")
    assert r.returncode == 1 and f"nothing listens at 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "checked in plaintext" not in r.stderr, r.stderr


def test_generate_says_a_seed_without_temperature_changes_nothing():
    r = tandem("generate", "hi", "--seed", "3", "--router", "127.0.0.1:1")
    assert "tandem generate: --seed (TANDEM_SAMPLING_SEED) without --temperature > 0: greedy decoding, it changes " \
        "nothing" in r.stderr, r.stderr
    r = tandem("generate", "hi", "--top-p", "0", "--router", "127.0.0.1:1")
    assert "changes nothing" not in r.stderr, r.stderr  # an invalid value: the router's error says so
    r = tandem("generate", "hi", "--seed", "3", "--temperature", "0.7", "--router", "127.0.0.1:1")
    assert "changes nothing" not in r.stderr, r.stderr


def test_health_of_an_http1_port_says_it_is_no_grpc_port():
    # the router's HTTP API or a /metrics port given to tandem health: it answers, in HTTP/1
    import http.server
    import threading
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = tandem("health", f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 1 and "answers in HTTP/1, not gRPC" in r.stderr, r.stderr
    assert "checked in plaintext" not in r.stderr, r.stderr


def test_tokenize_gives_the_ids_logit_bias_takes():
    """`tandem tokenize`: the shipped model's own token ids for a text (the router's tokenizer),
    one row per token on stderr, the ids (or with --bias a logit_bias object) as JSON on stdout."""
    import json

    from common.tokenizer import load_tokenizer
    from engine.model_source import load_config
    want = load_tokenizer(load_config("tandem-shakespeare")[2]).encode(" love and hate")
    r = tandem("tokenize", " love and hate")
    assert r.returncode == 0 and json.loads(r.stdout) == want and len(want) == 3
    assert "' love'" in r.stderr
    r = tandem("tokenize", " love love", "--bias", "-100")
    assert r.returncode == 0 and json.loads(r.stdout) == {str(want[0]): -100.0}  # each id once
    r = tandem("tokenize", "x", "--bias", "200")
    assert r.returncode == 2 and "--bias must be in [-100, 100]" in r.stderr
    words = load_tokenizer(load_config("tandem-shakespeare")[2]).decode(list(range(300, 800))).replace("\x00", "")
    r = tandem("tokenize", words, "--bias", "-100")  # more distinct tokens than a logit_bias takes
    assert r.returncode == 2 and "a logit_bias takes at most 300" in r.stderr, r.stderr
    r = subprocess.run([PY, "-m", "cli.main", "tokenize", b"a\xffb"], cwd=ROOT, capture_output=True, timeout=60)
    assert r.returncode == 2 and b"not valid UTF-8" in r.stderr and b"Traceback" not in r.stderr


def test_tokenize_takes_the_workers_model_from_the_config_file(tmp_path):
    """The model a cluster's workers serve, from the [worker] table, as TANDEM_MODEL or --model."""
    import json
    cfg = tmp_path / "tandem.toml"
    cfg.write_text('[worker]\nmodel = "tandem-tiny"\n')
    tiny = tandem("tokenize", "hello", "--model", "tandem-tiny")
    assert tiny.returncode == 0
    r = tandem("tokenize", "hello", "--config", str(cfg))
    assert r.returncode == 0 and json.loads(r.stdout) == json.loads(tiny.stdout), r.stderr
    assert json.loads(tandem("tokenize", "hello").stdout) != json.loads(tiny.stdout)  # the default: shakespeare
    from cli.tokens import WORKERS_DEFAULT_MODEL
    from engine.model_source import DEFAULT_MODEL
    assert WORKERS_DEFAULT_MODEL == DEFAULT_MODEL


@pytest.mark.parametrize("args", [("tokenize", "to be or not"), ("config", "show", "router")])
def test_a_closed_pipe_ends_a_client_quietly(args):
    """`tandem ... | head`: the reader gone before the output, no 'Broken pipe' line."""
    p = subprocess.Popen([PY, "-m", "cli.main", *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    _, err = p.communicate(timeout=60)
    assert "Broken pipe" not in err and "Traceback" not in err and p.returncode == 1, err


def test_cli_modules_do_not_hide_the_standard_library():
    """`python cli/main.py` puts cli/ first on sys.path: no module there may share a name with
    one of Python's own (cli/tokenize.py hid `tokenize`, which linecache imports)."""
    names = {f.stem for f in (ROOT / "cli").glob("*.py")}
    assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)


def test_the_command_of_an_exited_cluster_process_restarts_it_where_it_was():
    """What `tandem up` prints when a process of its cluster exits: its `tandem ROLE ...` line;
    a router's `--port 0` as the port its cluster's clients dial."""
    import types

    from cli.main import _command_of
    router = types.SimpleNamespace(args=[PY, "-m", "cli.main", "router", "--etcd", "127.0.0.1:2379", "--port", "0",
                                         "--tls-ca", "/tmp/run x/ca.pem"])
    assert _command_of(router, "127.0.0.1:50051") == \
        "tandem router --etcd 127.0.0.1:2379 --port 50051 --tls-ca '/tmp/run x/ca.pem'"
    worker = types.SimpleNamespace(args=[PY, "-m", "cli.main", "decode", "--port", "0"])
    assert _command_of(worker, "127.0.0.1:50051") == "tandem decode --port 0"  # a worker registers any port
