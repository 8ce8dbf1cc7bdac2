"""deploy/systemd: `systemd-analyze verify` accepts every unit with no message at all, the stop
timeout covers the drain budget, and the example config and env files load."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli import config
from cli.main import build_parser
from router.main import RouterOptions
from worker.host import WorkerOptions

SYSTEMD = Path(__file__).resolve().parent.parent / "deploy" / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
INSTALLED_TANDEM = "/opt/tandem/venv/bin/tandem"  # must match the units' ExecStart and docs/deploy.md
# After the drain: deregistration (<= 2 s, discovery/registration.py) and the gRPC server's grace
# (2 s, worker/host.py serve_worker), plus room for a slow process exit.
AFTER_DRAIN_S = 2 + 2 + 5


def unit(path: Path) -> dict[str, list[str]]:
    """'Section.Key' -> values, in order (systemd allows a key more than once)."""
    out: dict[str, list[str]] = {}
    section, text = "", path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def seconds(value: str) -> float:
    for suffix, scale in (("min", 60), ("ms", 0.001), ("s", 1)):
        if value.endswith(suffix):
            return float(value.removesuffix(suffix)) * scale
    return float(value)


def tandem_executable() -> str:
    """The `tandem` console script of the running environment (a real file verify can check)."""
    candidates = [Path(sys.executable).parent / "tandem", shutil.which("tandem")]
    found = next((str(c) for c in candidates if c and Path(c).is_file()), None)
    assert found, "no tandem console script: run `make setup` (pip install -e .)"
    return found


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze missing (make setup installs Debian's systemd package)")
def test_systemd_analyze_verify_is_silent(tmp_path):
    """Verify copies whose ExecStart points at binaries that exist here (verify checks that the
    command is executable); nothing else is changed. Any message, even a warning such as an
    unknown key, fails: verify itself exits 0 on those."""
    etcd = shutil.which("etcd")
    assert etcd, "etcd missing (make setup installs it)"
    for path in UNITS:
        text = path.read_text()
        assert INSTALLED_TANDEM in text or "/usr/bin/etcd" in text, path.name
        (tmp_path / path.name).write_text(text.replace(INSTALLED_TANDEM, tandem_executable())
                                          .replace("/usr/bin/etcd", etcd))
    # The templates themselves and one instance of each (specifiers such as %i expanded).
    names = [p.name for p in UNITS] + [p.name.replace("@.", "@0.") for p in UNITS if "@." in p.name]
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *[str(tmp_path / n) for n in names]],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    messages = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and not messages, messages


@pytest.mark.parametrize("name", [p.name for p in UNITS if p.name.startswith("tandem-") and "etcd" not in p.name])
def test_tandem_units_restart_stop_and_run_unprivileged(name):
    u = unit(SYSTEMD / name)
    role = name.removeprefix("tandem-").split("@")[0]
    # its key as a credential: the file stays root-only, only this instance's process gets a copy
    assert u["Service.ExecStart"] == [f"{INSTALLED_TANDEM} {role} --tls-key ${{CREDENTIALS_DIRECTORY}}/tls-key"]
    assert u["Service.LoadCredential"] == [f"tls-key:/etc/tandem/tls/{role}-%i-key.pem"]
    assert u["Service.Restart"] == ["on-failure"]
    assert u["Service.KillSignal"] == ["SIGTERM"]
    assert u["Service.KillMode"] == ["mixed"]  # one SIGTERM to the main process: a second skips the drain
    assert u["Service.User"] == ["tandem"] and u["Service.NoNewPrivileges"] == ["yes"]
    assert u["Service.EnvironmentFile"] == [f"/etc/tandem/{role}-%i.env"]
    assert "TANDEM_CONFIG=/etc/tandem/tandem.toml" in u["Service.Environment"]
    stop_s = seconds(u["Service.TimeoutStopSec"][0])
    # the router drains its open streams as a worker drains its requests (router/main.py drain)
    drain_s = (RouterOptions(etcd="127.0.0.1:2379") if role == "router" else WorkerOptions()).drain_timeout_s
    assert stop_s >= drain_s + AFTER_DRAIN_S, f"TimeoutStopSec {stop_s} s < drain {drain_s} s + {AFTER_DRAIN_S} s"
    if role != "router":
        assert "PrivateDevices" not in str(u)  # would hide the GPUs


def test_example_config_and_env_files_load_and_fit_the_stop_timeout():
    schema = config.Schema.of(build_parser())
    data = config.load_file(str(SYSTEMD / "tandem.toml"), schema)
    stop_s = min(seconds(unit(p)["Service.TimeoutStopSec"][0]) for p in UNITS if "prefill" in p.name or "decode" in p.name)
    assert data["worker"]["drain_timeout_s"] + AFTER_DRAIN_S <= stop_s
    known = {o.env for opts in schema.commands.values() for o in opts.values()}
    known |= {"TANDEM_METRICS_PORT", "CUDA_VISIBLE_DEVICES"}  # the observability options; not ours
    for env in sorted((SYSTEMD / "env").glob("*.env")):
        names = [line.split("=")[0] for line in env.read_text().splitlines() if line and line[0] != "#"]
        assert names and set(names) <= known, env.name
        assert "TANDEM_TLS_KEY" not in names  # the unit passes the key (a credential); a file's path would lose
        role = env.name.split("-")[0]
        assert (SYSTEMD / f"tandem-{role}@.service").exists()
