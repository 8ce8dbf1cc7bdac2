"""The router's HTTP API over HTTPS (`tandem up --https`, the router's --http-tls-cert and
--http-tls-key) and on an address of its own (--http-host): the official `openai` client and
`tandem bench --backend openai` against real workers over loopback, clients that do not trust
the certificate or speak plain HTTP refused, and the options' errors before anything listens."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from cli.cluster import LocalCluster
from engine.model_source import TINY
from harness import InProcessCluster, tandem_up

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def up(etcd_server, tmp_path_factory):
    """`tandem up --https` as LocalCluster starts it: mutual TLS, the HTTP API on a free port."""
    cluster = LocalCluster(model=TINY, etcd=etcd_server.endpoint, namespace="e2e-https", http_port=0, https=True,
                           worker_args=["--num-blocks", "128"], log_dir=str(tmp_path_factory.mktemp("https-logs")))
    asyncio.run(cluster.start())
    yield cluster
    asyncio.run(cluster.stop())


def test_https_api_serves_a_client_that_trusts_the_cluster_ca(up):
    assert up.http_url == f"https://{up.http_address}"
    with httpx.Client(verify=str(up.ca.ca_path), timeout=60) as http, \
            openai.OpenAI(base_url=f"{up.http_url}/v1", api_key="none", max_retries=0, http_client=http) as client:
        model = client.models.list().data[0].id
        first = client.completions.create(model=model, prompt="To be, or not", max_tokens=8, temperature=0)
        again = client.completions.create(model=model, prompt="To be, or not", max_tokens=8, temperature=0)
    assert first.usage.completion_tokens == 8 and first.choices[0].text == again.choices[0].text


def test_clients_that_do_not_trust_it_or_speak_plain_http_get_nothing(up):
    url = f"{up.http_url}/v1/models"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url, timeout=10)  # the system's trust store does not hold the cluster CA
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port: no answer that parses
        httpx.get(url.replace("https://", "http://"), timeout=10)
    r = httpx.get(url, verify=str(up.ca.ca_path), timeout=10)  # and the port still serves
    assert r.status_code == 200 and r.json()["data"], r.text


def test_bench_openai_backend_over_https_trusts_the_tls_ca(up, tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_TLS_CA"] = str(up.ca.ca_path)  # the router's gRPC port and the HTTPS API alike
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "--router", up.router_address, "--backend",
                        "openai", "--http-url", up.http_url, "--dataset", "synthetic-prefix", "--groups", "2",
                        "--prefix-len", "16", "--suffix-len", "16", "--num-requests", "4", "--output-tokens", "8",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0, summary


def test_http_host_puts_the_http_api_on_its_own_address(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-http-host")
    try:
        router = c.start("router", http_port=0, http_host="127.0.0.2")  # loopback, not --host's 127.0.0.1
        host, _, port = router.http_address.rpartition(":")
        assert host == "127.0.0.2" and router.address.startswith("127.0.0.1:")  # gRPC stays on --host
        assert httpx.get(f"http://127.0.0.2:{port}/v1/models", timeout=10).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    finally:
        c.close()


@pytest.mark.parametrize("overrides, record", [
    ({"http_host": "0.0.0.0"}, "127.0.0.1"),  # every interface: the gRPC record's host, not 0.0.0.0
    ({"host": "0.0.0.0", "advertise_host": "127.0.0.3"}, "127.0.0.3"),  # both on every interface
    ({"host": "0.0.0.0", "advertise_host": "127.0.0.3", "http_host": "127.0.0.2"}, "127.0.0.2"),
    # an IPv4-only API beside an IPv6 record: not the [::1] it does not listen on (the hostname's
    # address, or here, where that is loopback, 127.0.0.1)
    ({"host": "[::1]", "http_host": "0.0.0.0"}, "127.0.0.1"),
])
def test_the_discovery_record_names_where_clients_reach_the_http_api(etcd_server, tiny_model, overrides, record):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-http-record")
    try:
        router = c.start("router", http_port=0, **overrides)
        host, _, port = router.http_address.rpartition(":")
        assert host == record, router.http_address
        assert httpx.get(f"http://{router.http_address}/v1/models", timeout=10).status_code == 200
    finally:
        c.close()


@pytest.mark.parametrize("overrides, said", [
    ({"http_port": 0, "http_tls_cert": "x.pem"}, "--http-tls-cert and --http-tls-key go together"),
    ({"http_tls_cert": "x.pem", "http_tls_key": "y.pem"}, "which is off (--http-port -1): turn it on with --http-port"),
    ({"http_host": "127.0.0.2"}, "--http-host sets how the HTTP API listens, which is off"),
    ({"http_port": 0, "http_tls_cert": "README.md", "http_tls_key": "README.md"},
     "cannot load them as a server certificate and its key"),
    ({"http_port": 0, "http_tls_cert": "/nonexistent.pem", "http_tls_key": "/nonexistent.pem"},
     "--http-tls-cert /nonexistent.pem / --http-tls-key /nonexistent.pem: cannot load"),
])
def test_https_options_are_checked_before_anything_listens(overrides, said):
    from router.main import RouterOptions
    with pytest.raises(ValueError) as err:
        RouterOptions(etcd="127.0.0.1:2379", **overrides)
    assert said in str(err.value), err.value


@pytest.mark.parametrize("kw", [{"tls": False, "http_port": 0}, {"tls": True, "http_port": -1}])
def test_up_https_needs_tls_and_the_http_api(kw):
    with pytest.raises(ValueError, match="--https serves the HTTP API with the routers' cluster certificates"):
        LocalCluster(model=TINY, https=True, **kw)


def _served_certificate_name(address: str, ca: str) -> str:
    """The common name of the certificate a new TLS connection to address gets."""
    import socket
    import ssl
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=ca)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        subject = dict(x[0] for x in tls.getpeercert()["subject"])
    return subject["commonName"]


def test_sighup_loads_a_renewed_https_certificate_and_keeps_serving(up):
    # before: SIGHUP killed a router without --api-keys; a renewed certificate needed a restart
    import shutil
    import signal
    import time
    ca = str(up.ca.ca_path)
    assert _served_certificate_name(up.http_address, ca) == "router"
    renewed = up.ca.issue("router-renewed", ("router",))
    tls = up.log_dir / "tls"
    shutil.copy(renewed.cert, tls / "router.pem")
    shutil.copy(renewed.key, tls / "router-key.pem")
    up.procs["router"].send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while _served_certificate_name(up.http_address, ca) != "router-renewed":
        assert time.monotonic() < deadline, "the renewed certificate was not served"
        time.sleep(0.1)
    assert up.procs["router"].poll() is None
    assert httpx.get(f"{up.http_url}/v1/models", verify=ca, timeout=10).status_code == 200
    # a pair that does not load (a certificate half-copied, beside the old key) keeps the served
    # one whole: it used to leave the serving context with the new certificate and no key
    shutil.copy(up.ca.issue("router-third", ("router",)).cert, tls / "router.pem")
    up.procs["router"].send_signal(signal.SIGHUP)
    time.sleep(1)
    assert _served_certificate_name(up.http_address, ca) == "router-renewed"
    assert "HTTPS certificate kept" in (up.log_dir / "router.log").read_text()


def test_tandem_up_prints_the_scheme_its_router_serves(tmp_path):
    """`tandem up --https` on an address of its own, and HTTPS set by the router's own variables,
    print https:// URLs that answer (the router's settings used to be printed as http://, and
    --https certificates named loopback only); SIGHUP to `tandem up` reaches its router;
    `tandem bench --http-ca` trusts a certificate of another CA than the cluster's."""
    import re
    import signal
    from common.certs import LocalCa
    own = LocalCa(tmp_path / "own").issue("api", ("router",))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    for extra, variables in ((["--https"], {"TANDEM_HTTP_HOST": "127.0.0.2"}),
                             # with a TANDEM_TLS_CA an earlier run exported: said to be stale, not "applied"
                             ([], {"TANDEM_HTTP_TLS_CERT": own.cert, "TANDEM_HTTP_TLS_KEY": own.key,
                                   "TANDEM_TLS_CA": own.ca})):
        up, out = tandem_up(["--mocker", "1", "--port", "0", "--http-port", "0", "--log-dir", str(tmp_path / "runs"),
                             *extra], {**env, **variables})
        try:
            url = re.search(r"HTTP API at (https://\S+)/v1", out)
            assert url, out
            trust = own.ca if variables.get("TANDEM_HTTP_TLS_CERT") else re.search(r"\(trust (\S+):", out).group(1)
            assert httpx.get(f"{url.group(1)}/v1/models", verify=trust, timeout=10).status_code == 200
            if extra:
                assert url.group(1).startswith("https://127.0.0.2:")
                up.send_signal(signal.SIGHUP)
                assert "SIGHUP passed to router" in up.stdout.readline()
                assert httpx.get(f"{url.group(1)}/v1/models", verify=trust, timeout=10).status_code == 200
            else:
                assert f"this shell's TANDEM_TLS_CA ({own.ca}) is not this cluster's CA" in out, out
                applied = re.search(r"TANDEM_\* variables of this shell apply to every process it starts.*", out)
                assert applied and "TANDEM_TLS_CA" not in applied.group(0), out
                router = re.search(r"router at (\S+),", out).group(1)
                r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "--router", router, "--backend",
                                    "openai", "--http-url", url.group(1), "--http-ca", own.ca, "--dataset", "mt-bench",
                                    "--num-requests", "2", "--output-tokens", "4"], cwd=ROOT, capture_output=True,
                                   text=True, timeout=120, env=env)
                assert r.returncode == 0, r.stderr
        finally:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=60)


def test_an_encrypted_key_is_refused_without_a_prompt_and_a_bracketed_host_taken(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from common.certs import LocalCa
    from router.main import RouterOptions
    files = LocalCa(tmp_path).issue("api", ("router",))
    key = load_pem_private_key(Path(files.key).read_bytes(), password=None)
    encrypted = tmp_path / "encrypted-key.pem"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    # stdin closed: a prompt for the passphrase would read nothing and fail differently
    with pytest.raises(ValueError, match="the key is encrypted: give it decrypted"):
        RouterOptions(etcd="127.0.0.1:2379", http_port=0, http_tls_cert=files.cert, http_tls_key=str(encrypted))
    assert RouterOptions(etcd="127.0.0.1:2379", http_port=0, http_host="[::1]").http_host == "::1"


def test_bench_over_plain_http_to_the_https_port_says_to_use_https(up, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_TLS_CA"] = str(up.ca.ca_path)
    plain = up.http_url.replace("https://", "http://")
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "--router", up.router_address, "--backend",
                        "openai", "--http-url", plain, "--dataset", "mt-bench", "--num-requests", "1",
                        "--output-tokens", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 1 and f"give --http-url {up.http_url}" in r.stdout + r.stderr, r.stdout + r.stderr
