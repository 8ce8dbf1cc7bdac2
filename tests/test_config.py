"""Configuration: flag > TANDEM_* variable > TOML file > default, file errors naming the key and
the file, `tandem config show`, the `tandem health` probe and --advertise-host."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cli import config
from cli.health import check
from cli.health import main as health_main
from cli.main import build_parser
from cli.main import main as tandem
from worker.host import WorkerOptions

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_tandem_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


def effective(argv: list[str]) -> dict[str, config.Resolved]:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    assert not rest
    top, mine, _ = config.effective(parser, args, args.command)
    return {**top, **mine}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tandem.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("flag, env, file, want, source", [
    (None, None, None, 0, "default"),  # 0 = automatic: 4096 blocks unless --mem-fraction-static is set
    (None, None, 100, 100, "file {path}:decode.num_blocks"),
    (None, 200, 100, 200, "env TANDEM_NUM_BLOCKS"),
    (300, 200, 100, 300, "flag --num-blocks"),
    (300, None, None, 300, "flag --num-blocks"),
])
def test_precedence_flag_env_file_default(tmp_path, monkeypatch, flag, env, file, want, source):
    path = write(tmp_path, f"[decode]\nnum_blocks = {file}\n" if file is not None else "")
    if env is not None:
        monkeypatch.setenv("TANDEM_NUM_BLOCKS", str(env))
    argv = ["decode", "--config", path] + (["--num-blocks", str(flag)] if flag is not None else [])
    r = effective(argv)["num_blocks"]
    assert (r.value, r.source) == (want, source.format(path=path))


def test_subcommand_table_beats_worker_table_beats_top_level(tmp_path):
    path = write(tmp_path, 'etcd = "top:2379"\nport = 1\nnum_blocks = 7\n'
                           '[worker]\nport = 2\nchunk_size = 64\n[decode]\nport = 3\n')
    decode = effective(["decode", "--config", path])
    assert (decode["port"].value, decode["port"].source) == (3, f"file {path}:decode.port")
    assert (decode["chunk_size"].value, decode["chunk_size"].source) == (64, f"file {path}:worker.chunk_size")
    assert (decode["etcd"].value, decode["num_blocks"].value) == ("top:2379", 7)
    prefill = effective(["prefill", "--config", path])
    assert (prefill["port"].value, prefill["chunk_size"].value) == (2, 64)
    router = effective(["--config", path, "router"])  # [worker] is not the router's
    assert (router["port"].value, router["port"].source) == (1, f"file {path}:port")
    assert router["etcd"].value == "top:2379"


def test_config_from_env_and_top_level_flag_and_kinds(tmp_path, monkeypatch):
    path = write(tmp_path, 'log_level = "debug"\n[generate]\nstop = ["\\n\\n", "END"]\ntemperature = 1\n'
                           '[worker]\ndrain_timeout_s = 12\n')
    monkeypatch.setenv("TANDEM_CONFIG", path)
    gen = effective(["generate", "hi"])
    assert gen["log_level"].value == "debug"
    assert gen["stop"].value == ["\n\n", "END"]
    assert gen["temperature"].value == 1.0 and isinstance(gen["temperature"].value, float)
    assert effective(["prefill"])["drain_timeout_s"].value == 12.0
    monkeypatch.setenv("TANDEM_STOP", '["a", "b"]')
    monkeypatch.setenv("TANDEM_SAMPLING_SEED", "5")
    monkeypatch.setenv("TANDEM_SEED", "9")  # the workers' weight seed, not generate's
    gen = effective(["--log-level", "warning", "generate", "hi", "--config", path])
    assert (gen["stop"].value, gen["sampling_seed"].value) == (["a", "b"], 5)
    assert (gen["log_level"].value, gen["log_level"].source) == ("warning", "flag --log-level")
    assert effective(["decode"])["seed"].value == 9


@pytest.mark.parametrize("text, message", [
    ("[decode]\nmax_runing = 3\n", "[decode]: unknown key 'max_runing'; did you mean 'max_running'?"),
    ("[router]\nnum_blocks = 3\n", "[router]: unknown key 'num_blocks'; it is an option of "),
    ("[decode]\nrouter_mode = \"kv\"\n", "[decode]: unknown key 'router_mode'; it is an option of [router], [up]"),
    ("[routr]\nport = 3\n", "unknown table 'routr'; did you mean 'router'?"),
    ("drain_timeout = 3\n", "unknown key 'drain_timeout'; did you mean 'drain_timeout_s'?"),
    ("[decode]\nport = \"50051\"\n", "[decode] port: expected an integer (as for --port), got str '50051'"),
    ("[decode]\nport = true\n", "[decode] port: expected an integer (as for --port), got bool True"),
    ("[decode]\nport = 1.5\n", "[decode] port: expected an integer"),
    ("lease_ttl_s = \"10\"\n", "lease_ttl_s: expected a number (as for --lease-ttl)"),
    ("[generate]\nstop = [1]\n", "[generate] stop: expected an array of strings"),
    ("[decode\n", "config file {path}: "),
])
def test_file_errors_name_the_file_and_the_key(tmp_path, text, message, capsys):
    path = write(tmp_path, text)
    with pytest.raises(config.ConfigError) as err:
        effective(["decode", "--config", path])
    assert f"config file {path}" in str(err.value)
    assert message.format(path=path) in str(err.value)
    assert tandem(["decode", "--config", path]) == 2  # before anything starts, one line
    assert capsys.readouterr().err.strip() == f"tandem: {err.value}"


def test_missing_file_and_bad_env_are_errors(tmp_path, monkeypatch):
    with pytest.raises(config.ConfigError, match=f"config file {tmp_path}/nope.toml: No such file"):
        effective(["router", "--config", str(tmp_path / "nope.toml")])
    monkeypatch.setenv("TANDEM_NUM_BLOCKS", "many")
    with pytest.raises(config.ConfigError, match="TANDEM_NUM_BLOCKS='many'"):
        effective(["decode"])
    effective(["router"])  # a variable only the workers have does not concern the router


def test_config_show_prints_each_value_with_its_source_as_toml(tmp_path):
    path = write(tmp_path, 'etcd = "10.0.0.5:2379"\n[worker]\nnum_blocks = 8192\n[decode]\nmax_running = 32\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(PYTHONPATH=str(ROOT), TANDEM_CONFIG=path, TANDEM_CHUNK_SIZE="128")
    out = subprocess.run([sys.executable, "-m", "cli.main", "config", "show", "decode", "--port", "50062"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if "=" in line and line[0] != "#"}
    assert lines["port"].split("#")[1].strip() == "flag --port"
    assert lines["chunk_size"].split("#")[1].strip() == "env TANDEM_CHUNK_SIZE"
    assert lines["num_blocks"].split("#")[1].strip() == f"file {path}:worker.num_blocks"
    assert lines["max_running"].split("#")[1].strip() == f"file {path}:decode.max_running"
    assert lines["etcd"].split("#")[1].strip() == f"file {path}:etcd"
    assert lines["torch_threads"].split("#")[1].strip() == "default"
    assert f"# config file: {path} (env TANDEM_CONFIG)" in out
    parsed = tomllib.loads(out)  # the output is itself a config file
    assert parsed["decode"]["port"] == 50062 and parsed["decode"]["num_blocks"] == 8192
    assert parsed["decode"]["drain_timeout_s"] == 30.0 and parsed["log_level"] == "info"


def test_full_config_show_round_trips_through_the_loader(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_STOP", "END")
    assert tandem(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert {"[router]", "[prefill]", "[decode]", "[up]", "[generate]", "[explain]", "[health]"} <= set(out.split("\n"))
    assert "# sampling_seed = (unset)" in out  # generate's --seed has no default
    data = config.load_file(write(tmp_path, out), config.Schema.of(build_parser()))
    assert data["generate"]["stop"] == ["END"] and data["router"]["router_mode"] == "kv"
    assert tandem(["config", "show", "demo"]) == 2
    assert "has no options" in capsys.readouterr().err


def test_advertised_host_on_a_wildcard_host(monkeypatch):
    import socket

    from common.grpc_server import advertised_host
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("::", "fd00::7") == "[fd00::7]"  # an IPv6 pod IP, ready for host:port
    assert advertised_host("[::1]") == "[::1]"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.9.8.7")  # a container's own IP
    assert advertised_host("0.0.0.0") == "10.9.8.7"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's bare-host mapping
    with pytest.raises(ValueError, match="set --advertise-host"):
        WorkerOptions(host="0.0.0.0")
    assert WorkerOptions(host="0.0.0.0", advertise_host="10.1.2.3").advertise_host == "10.1.2.3"


def test_health_probe_follows_the_serving_status(monkeypatch, capsys):
    from common.grpc_server import start_server

    async def body() -> None:
        server = await start_server("127.0.0.1:0", [], ["tandem.v1.FrontendService"])
        address = f"127.0.0.1:{server.port}"
        try:
            assert await asyncio.to_thread(check, address) == (True, "SERVING")
            monkeypatch.setenv("TANDEM_PORT", str(server.port))  # the container's way: no address
            assert await asyncio.to_thread(health_main, []) == 0
            # a router elsewhere: --router before TANDEM_PORT; TANDEM_ROUTER (the clients') is not read, so
            # a container exporting it for them still checks its own server
            monkeypatch.setenv("TANDEM_PORT", "1")
            assert await asyncio.to_thread(health_main, ["--router", address]) == 0
            monkeypatch.setenv("TANDEM_ROUTER", address)
            assert await asyncio.to_thread(health_main, []) == 1  # 127.0.0.1:1: nothing there
            monkeypatch.setenv("TANDEM_PORT", str(server.port))
            monkeypatch.setenv("TANDEM_ROUTER", "127.0.0.1:1")
            assert await asyncio.to_thread(health_main, []) == 0
            monkeypatch.delenv("TANDEM_ROUTER")
            await server.set_serving(False)  # what a draining or wedged worker reports
            assert await asyncio.to_thread(health_main, ["--service", "tandem.v1.FrontendService"]) == 1
            assert await asyncio.to_thread(check, address, "no.such.Service") == (False, "NOT_FOUND: ")
        finally:
            await server.stop(0)
        ok, status = await asyncio.to_thread(check, address, "", 1.0)
        assert not ok and status.startswith("UNAVAILABLE")

    asyncio.run(body())
    assert "NOT_SERVING" in capsys.readouterr().err


def test_an_option_name_means_one_kind_and_one_variable_everywhere():
    """A top-level key applies to every subcommand with that option, so they must agree."""
    schema = config.Schema.of(build_parser())
    seen: dict[str, tuple[type, str]] = {}
    for opts in [schema.top, *schema.commands.values()]:
        for name, opt in opts.items():
            assert seen.setdefault(name, (opt.kind, opt.env)) == (opt.kind, opt.env), name
    # and no two options share a variable under different names (generate's seed has its own)
    names_by_env: dict[str, set[str]] = {}
    for name, (_, env) in seen.items():
        names_by_env.setdefault(env, set()).add(name)
    assert all(len(names) == 1 for names in names_by_env.values()), names_by_env


def test_gil_switch_interval_is_an_option_with_its_bounds(monkeypatch):
    # the workers' sys.setswitchinterval, in microseconds: 200 unless set (flag, env, file)
    assert WorkerOptions().gil_switch_interval_us == 200
    monkeypatch.setenv("TANDEM_GIL_SWITCH_INTERVAL_US", "50")
    r = effective(["decode"])["gil_switch_interval_us"]
    assert (r.value, r.source) == (50, "env TANDEM_GIL_SWITCH_INTERVAL_US")
    for bad in (0, 5001):
        with pytest.raises(ValueError, match=r"--gil-switch-interval-us must be in \[1, 5000\]"):
            WorkerOptions(gil_switch_interval_us=bad)
    monkeypatch.delenv("TANDEM_GIL_SWITCH_INTERVAL_US")
    with pytest.raises(SystemExit, match=r"tandem: --gil-switch-interval-us must be in \[1, 5000\]"):
        tandem(["decode", "--gil-switch-interval-us", "0"])  # refused before anything starts


def test_config_show_names_a_value_the_command_would_refuse(tmp_path, capsys):
    path = write(tmp_path, "[decode]\nstream_interval = -3\n")
    assert tandem(["config", "show", "decode", "--config", path]) == 2
    captured = capsys.readouterr()
    assert "# tandem decode would refuse this: --stream-interval must be >= 1 token, got -3" in captured.out
    assert "[decode] --stream-interval must be >= 1 token, got -3" in captured.err
    assert tandem(["config", "show", "decode", "--config", path, "--stream-interval", "4"]) == 0  # a flag wins
    capsys.readouterr()
    assert tandem(["config", "show", "--config", path]) == 0  # the overview notes it only
    out = capsys.readouterr().out
    assert "would refuse this: --stream-interval" in out and "tandem up passes" not in out
    # a refusal tandem up makes moot (it turns the HTTP API on itself) says so
    path = write(tmp_path, '[router]\nhttp_host = "0.0.0.0"\n')
    assert tandem(["config", "show", "router", "--config", path]) == 2
    assert ("leave --http-host out (tandem up passes --http-port itself: a file for tandem up is refused for this "
            "only where its --http-port is -1)") in capsys.readouterr().out


def test_one_roles_options_reach_that_role_only(tmp_path, monkeypatch, capsys):
    """`tandem up` runs every process with one environment and one file: TANDEM_EP_SIZE and
    a [worker] pp_size configure the role they apply to and leave the other at its default (a
    prefill worker refused --ep-size, a decode worker --pp-size); the other role's flag, or its
    key in that role's own table, is refused by name."""
    monkeypatch.setenv("TANDEM_EP_SIZE", "2")
    path = write(tmp_path, "[worker]\npp_size = 3\npp_layer_partition = \"1,1,1\"\n")
    decode, prefill = effective(["decode", "--config", path]), effective(["prefill", "--config", path])
    assert (decode["ep_size"].value, decode["ep_size"].source) == (2, "env TANDEM_EP_SIZE")
    assert "pp_size" not in decode and "ep_size" not in prefill
    assert (prefill["pp_size"].value, prefill["pp_layer_partition"].value) == (3, "1,1,1")
    for argv, message in ((["prefill", "--ep-size", "2"], "--ep-size applies to decode workers only"),
                          (["decode", "--pp-size=2"], "--pp-size applies to prefill workers only")):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # config show names the role too
        tandem(["config", "show", "prefill", "--ep-size", "2"])
    assert exc.value.code == 2 and "--ep-size applies to decode workers only" in capsys.readouterr().err
    args = build_parser().parse_args(["prefill", "--ep-size", "1"])  # what a prefill worker runs anyway
    assert not hasattr(args, "ep_size")
    bad = write(tmp_path, "[prefill]\nep_size = 2\n")
    with pytest.raises(config.ConfigError, match="ep_size"):
        effective(["prefill", "--config", bad])


def test_container_health_check_takes_its_options_from_a_config_file(tmp_path, capsys):
    """`python -m cli.health --config FILE` (or TANDEM_CONFIG): the top level's and [health]'s
    keys of the file; a wrong type there is one line and exit 1, not a usage error."""
    good = write(tmp_path, 'port = 1\nlog_level = "info"\n[router]\nrouter_mode = "kv"\n[health]\nhealth_timeout_s = 0.5\n')
    for argv in (["--config", good], [f"--config={good}"]):
        assert health_main(argv) == 1  # 127.0.0.1:1 from the file: nothing listens there
        assert "127.0.0.1:1" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('[health]\nhealth_timeout_s = "soon"\n')
    assert health_main(["--config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "health_timeout_s" in err and "Traceback" not in err
