"""The shipped deploy/systemd configuration runs a cluster: router, prefill and decode started the
way the units start them (`tandem <role>` with no flags, TANDEM_CONFIG plus the instance's env
file), with the certificates `tandem certs` makes as docs/deploy.md says, mutual TLS between the
processes and with an etcd that takes only certificates of the cluster CA (as
tandem-etcd.service runs it), on 0.0.0.0 with the advertised address, answering health checks
and a request whose tokens match the reference, and a worker exits 0 after its drain on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from cli.client import frontend_stub, generate
from cli.health import check
from cli.main import main
from common.tls import TlsFiles
from discovery.etcd_server import EtcdServer
from common.pb.tandem.v1 import frontend_pb2
from discovery.watcher import InstanceWatcher
from engine.reference import reference_generate
from harness import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments and blanks skipped)."""
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and line[0] != "#")


def unit_command(role: str, tls_dir: Path, credentials: Path) -> list[str]:
    """`tandem`'s arguments in instance 0 of the role's unit, as systemd runs it: each
    LoadCredential= file copied into `credentials` (systemd's $CREDENTIALS_DIRECTORY; from the
    test's folder instead of /etc/tandem/tls), and ${CREDENTIALS_DIRECTORY} in ExecStart= set to it."""
    import shutil
    text = (SYSTEMD / f"tandem-{role}@.service").read_text()
    credentials.mkdir()
    for line in text.splitlines():
        if line.startswith("LoadCredential="):
            name, _, source = line.removeprefix("LoadCredential=").partition(":")
            shutil.copy(source.replace("%i", "0").replace("/etc/tandem/tls", str(tls_dir)), credentials / name)
    start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    argv = start.removeprefix("ExecStart=").replace("${CREDENTIALS_DIRECTORY}", str(credentials)).split()
    assert argv[0].endswith("/tandem"), start
    return argv[1:]




def local_config(etcd: str, tls_dir: Path) -> str:
    """The example config with only what a site must edit changed (and the test model, and the
    certificates' folder)."""
    text = (SYSTEMD / "tandem.toml").read_text()
    for old, new in [('etcd = "https://127.0.0.1:2379"', f'etcd = "{etcd}"'),
                     ('tls_ca = "/etc/tandem/tls/ca.pem"', f'tls_ca = "{tls_dir}/ca.pem"'),
                     ('advertise_host = "192.0.2.10"', 'advertise_host = "127.0.0.1"'),
                     ('model = "tandem-shakespeare"', 'model = "tandem-tiny"'),
                     ('namespace = "default"', 'namespace = "e2e-deploy"'),
                     ("num_blocks = 4096", "num_blocks = 512")]:
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_units_configuration_runs_a_cluster(tiny_model, tmp_path):
    tls_dir = tmp_path / "tls"
    assert main(["certs", str(tls_dir), "router-0:router", "prefill-0:prefill", "decode-0:decode", "etcd:etcd",
                 "client:client"]) == 0
    client = TlsFiles(str(tls_dir / "client.pem"), str(tls_dir / "client-key.pem"), str(tls_dir / "ca.pem")).load()
    etcd = EtcdServer(tls=TlsFiles(str(tls_dir / "etcd.pem"), str(tls_dir / "etcd-key.pem"), str(tls_dir / "ca.pem")))
    etcd.start()
    assert etcd.endpoint.startswith("https://")
    (tmp_path / "tandem.toml").write_text(local_config(etcd.endpoint, tls_dir))
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    ports, procs, envs = {}, {}, {}
    try:
        for role in ("router", "prefill", "decode"):
            env = {**base, **env_file(SYSTEMD / "env" / f"{role}-0.env"), "PYTHONPATH": str(ROOT),
                   "PYTHONUNBUFFERED": "1", "TANDEM_CONFIG": str(tmp_path / "tandem.toml")}
            env["TANDEM_TLS_CERT"] = env["TANDEM_TLS_CERT"].replace("/etc/tandem/tls", str(tls_dir))
            argv = unit_command(role, tls_dir, tmp_path / f"credentials-{role}")  # the key: a credential
            env.pop("TANDEM_METRICS_PORT")  # fixed ports would collide with parallel runs
            if "TANDEM_HTTP_PORT" in env:  # the router's HTTP API: 8000 in its env file
                env["TANDEM_HTTP_PORT"] = str(free_port())
            assert env["TANDEM_PORT"].isdigit()  # each instance's port comes from its env file; here a free one
            env["TANDEM_PORT"] = str(free_port())
            ports[role] = int(env["TANDEM_PORT"])
            # the probes below run as a container's HEALTHCHECK does, where the key is a variable
            envs[role] = {**env, "TANDEM_TLS_KEY": str(tls_dir / f"{role}-0-key.pem")}
            with open(tmp_path / f"{role}.log", "wb") as log:
                procs[role] = subprocess.Popen([sys.executable, "-m", "cli.main", *argv], env=env, cwd=tmp_path,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        for role, port in ports.items():
            while check(f"127.0.0.1:{port}", timeout_s=1.0, creds=client) != (True, "SERVING"):
                assert procs[role].poll() is None, (tmp_path / f"{role}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{role} not SERVING"
                time.sleep(0.2)

        async def request() -> tuple[list, list[int], set[str]]:
            async with InstanceWatcher(etcd.endpoint, "e2e-deploy", tls=client) as watcher:
                try:  # SERVING comes before a worker's record is in etcd: wait for all three records
                    view = await watcher.wait_for(lambda v: len(v) >= 3, timeout=max(60.0, deadline - time.monotonic()))
                except (TimeoutError, asyncio.TimeoutError):
                    logs = {r: (tmp_path / f"{r}.log").read_text()[-2000:] for r in procs}
                    raise AssertionError(f"etcd holds {sorted(watcher.instances())}, not all three; logs: {logs}")
            ch, stub = frontend_stub(f"127.0.0.1:{ports['router']}", client)
            try:
                while True:  # until the router's etcd view has both workers, at their advertised address
                    try:
                        resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
                        if len(resp.candidates) >= 2:
                            break
                    except grpc.aio.AioRpcError:
                        pass
                    assert time.monotonic() < deadline, "router does not see both workers"
                    await asyncio.sleep(0.1)
                c = await generate(stub, text="Configured by a file.", max_tokens=8, timeout_s=120)
                return list(resp.candidates), c.token_ids, {i.address for i in view.values()}
            finally:
                await ch.close()

        candidates, tokens, addresses = asyncio.run(request())
        assert addresses == {f"127.0.0.1:{p}" for p in ports.values()}  # advertise_host, not 0.0.0.0
        assert {c.role for c in candidates} == {"prefill", "decode"}
        tok = tiny_model.tokenizer()
        assert tokens == reference_generate(tiny_model.model, tok.encode("Configured by a file."), 8,
                                            tiny_model.config.eos_token_ids)
        # the container's HEALTHCHECK (python -m cli.health, no flags) beside each process: the CA from
        # the file, the instance's certificate from its env file; then the whole TLS set in the file,
        # as the Kubernetes ConfigMap has it
        for role in ports:
            probe = subprocess.run([sys.executable, "-m", "cli.health"], env=envs[role], cwd=tmp_path,
                                   capture_output=True, text=True, timeout=60)
            assert probe.returncode == 0 and "SERVING" in probe.stdout, (role, probe.stdout, probe.stderr)
        env = dict(envs["decode"])
        all_in_file = tmp_path / "all-tls.toml"
        all_in_file.write_text((tmp_path / "tandem.toml").read_text() + "\n[health]\n" + "".join(
            f'{key.removeprefix("TANDEM_").lower()} = "{env.pop(key)}"\n' for key in ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY")))
        probe = subprocess.run([sys.executable, "-m", "cli.health"], env={**env, "TANDEM_CONFIG": str(all_in_file)},
                               cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0, (probe.stdout, probe.stderr)
        # without a certificate the worker refuses the check: unhealthy, one line, no traceback
        probe = subprocess.run([sys.executable, "-m", "cli.health"], env=env, cwd=tmp_path, capture_output=True,
                               text=True, timeout=60)
        assert probe.returncode == 1 and "Traceback" not in probe.stderr, probe.stderr
        procs["decode"].send_signal(signal.SIGTERM)  # what systemctl stop sends
        assert procs["decode"].wait(45) == 0  # drained within TimeoutStopSec
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        etcd.stop()
