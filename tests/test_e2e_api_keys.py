"""API keys and tenants at the router's front (--api-keys, router/api_keys.py, docs/security.md)
end to end: a real etcd, the router's gRPC and HTTP APIs, real workers and KV transfers.
Missing and wrong keys are refused on both APIs, the admin-only calls refuse other keys, and
one tenant cannot detect another's cached prefix: not with ExplainRoute, not through
cached_tokens in usage, while tenants of one cache group do share it."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.reference import reference_generate
from harness import InProcessCluster
from worker.host import WorkerOptions

pytestmark = pytest.mark.e2e
KEYS = {"alice": "tk-alice-0123456789abcdef", "bob": "tk-bob-0123456789abcdef0", "ops": "tk-ops-0123456789abcdef0",
        "carol": "tk-carol-0123456789abcdef", "dave": "tk-dave-0123456789abcdef0"}
KEY_FILE = f"""
[[keys]]
key = "{KEYS['alice']}"
tenant = "alice"

[[keys]]
key = "{KEYS['bob']}"
tenant = "bob"

[[keys]]
key = "{KEYS['ops']}"
tenant = "ops"
admin = true

[[keys]]
key = "{KEYS['carol']}"
tenant = "carol"
cache_group = "docs"

[[keys]]
key = "{KEYS['dave']}"
tenant = "dave"
cache_group = "docs"
"""


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model, one_torch_thread, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEY_FILE)
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-api-keys",
                         worker_opts=WorkerOptions(num_blocks=256))
    c.router = c.start("router", http_port=0, api_keys=str(path))
    c.prefill = c.start("prefill")
    c.decode = c.start("decode")
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.router.address) as ch:
        yield frontend_pb2_grpc.FrontendServiceStub(ch)


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def doc(n: int, offset: int) -> list[int]:
    return [(2000 + 13 * i + offset) % 150000 for i in range(n)]


def run(stub, tenant: str, prompt: list[int], max_tokens: int = 3) -> tuple[list[int], frontend_pb2.Usage]:
    req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens))
    msgs = list(stub.Generate(req, metadata=auth(tenant), timeout=60))
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_key_given_twice_is_refused_on_both_apis(cluster, stub):
    """Two authorization values: which one counts must not depend on the API (gRPC metadata kept
    the last, HTTP the first), so neither does: UNAUTHENTICATED / 401, naming the repeat."""
    twice = (("authorization", f"Bearer {KEYS['alice']}"), ("authorization", f"Bearer {KEYS['ops']}"))
    with pytest.raises(grpc.RpcError) as e:
        stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), metadata=twice, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "given 2 times" in e.value.details()
    r = httpx.post(f"http://{cluster.router.http_address}/v1/completions", json={"prompt": "a", "max_tokens": 1},
                   headers=[("authorization", f"Bearer {KEYS['alice']}"), ("authorization", f"Bearer {KEYS['bob']}")])
    assert r.status_code == 401 and "given 2 times" in r.json()["error"]["message"], r.text


def test_a_client_without_a_key_learns_nothing_of_the_body(cluster):
    """Without a key, a generation route answers 401 before it reads the body: not a 400 that
    tells the validation rules to whoever asks."""
    url = f"http://{cluster.router.http_address}/v1/completions"
    for body in (b"{bad", b'{"prompt": "x", "max_tokens": "zz"}', b'{"prompt": "x"}'):
        r = httpx.post(url, content=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (body, r.text)
    r = httpx.post(url, content=b"{bad", headers={"authorization": f"Bearer {KEYS['bob']}"})
    assert r.status_code == 400  # with a key, the body's own error


def test_grpc_refuses_missing_and_wrong_keys(stub):
    req = frontend_pb2.GenerateRequest(token_ids=[1, 2, 3], sampling=sampling_pb2.SamplingParams(max_tokens=1))
    for metadata in [(), (("authorization", "Bearer tk-not-a-key-0123456789"),), (("authorization", KEYS["bob"]),)]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=metadata, timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
        assert e.value.details().startswith("authorization"), e.value.details()
        assert code_of(lambda: stub.ListModels(frontend_pb2.ListModelsRequest(), metadata=metadata,
                                               timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    assert stub.ListModels(frontend_pb2.ListModelsRequest(), metadata=auth("bob"), timeout=10).models


def test_explain_and_cluster_status_need_an_admin_key(stub):
    explain = frontend_pb2.GenerateRequest(token_ids=doc(64, 1))
    for tenant in ("alice", "carol"):
        assert code_of(lambda: stub.ExplainRoute(explain, metadata=auth(tenant), timeout=10)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), metadata=auth(tenant),
                                                  timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    assert stub.ExplainRoute(explain, metadata=auth("ops"), timeout=10).candidates
    assert stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), metadata=auth("ops"), timeout=10)


def test_a_tenant_cannot_detect_another_tenants_cached_prefix(stub, tiny_model):
    prompt = doc(80, 2)  # five full blocks
    want = reference_generate(tiny_model.model, prompt, 3, tiny_model.config.eos_token_ids)
    bob_first, u = run(stub, "bob", prompt)
    assert bob_first == want and u.cached_tokens == 0
    bob_again, u = run(stub, "bob", prompt)
    assert bob_again == want and u.cached_tokens >= 64  # bob's own prefix cache works
    alice, u = run(stub, "alice", prompt)
    assert alice == want  # the same tokens, computed afresh:
    assert u.cached_tokens == 0  # nothing of bob's prefix was hit
    # The admin's route explanation (its own tenant's view) sees no overlap either.
    resp = stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=prompt), metadata=auth("ops"), timeout=10)
    assert all(c.overlap_blocks == 0 for c in resp.candidates), resp.text


def test_tenants_of_one_cache_group_share_their_prefix(stub, tiny_model):
    prompt = doc(80, 3)
    run(stub, "carol", prompt)
    dave, u = run(stub, "dave", prompt)
    assert dave == reference_generate(tiny_model.model, prompt, 3, tiny_model.config.eos_token_ids)
    assert u.cached_tokens >= 64
    _, u = run(stub, "alice", prompt)
    assert u.cached_tokens == 0


def test_http_api_needs_a_key(cluster, tiny_model):
    base = f"http://{cluster.router.http_address}"
    body = {"model": tiny_model.name, "prompt": doc(40, 4), "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer tk-not-a-key-0123456789"}, {"Authorization": "Basic abc"}):
        for r in (httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30),
                  httpx.get(f"{base}/v1/models", headers=headers, timeout=30)):
            assert r.status_code == 401, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["message"].startswith("authorization"), err
            assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    r = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200  # probes need no key


def test_http_usage_shows_no_cross_tenant_cache_hit(cluster, tiny_model):
    prompt = doc(80, 5)
    url = f"http://{cluster.router.http_address}/v1"
    with openai.OpenAI(base_url=url, api_key=KEYS["bob"], max_retries=0, timeout=60) as bob, \
            openai.OpenAI(base_url=url, api_key=KEYS["alice"], max_retries=0, timeout=60) as alice:
        for _ in range(2):
            r = bob.completions.create(model=tiny_model.name, prompt=prompt, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens >= 64
        r = alice.completions.create(model=tiny_model.name, prompt=prompt, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_key_file_errors_name_the_flag_and_entry(tmp_path):
    from router.api_keys import KeyRing
    cases = {"keys.toml": ("[[keys]]\nkey = 'short'\ntenant = 'a'\n", "keys[0]: key must be"),
             "dup.toml": (f"[[keys]]\nkey = '{KEYS['bob']}'\ntenant = 'a'\n[[keys]]\nkey = '{KEYS['bob']}'\n"
                          "tenant = 'b'\n", "keys[1]: this key is listed twice"),
             "extra.json": (json.dumps({"keys": [{"key": KEYS["bob"], "tenant": "b", "role": "x"}]}),
                            "keys[0]: unknown field role"),
             "none.json": ("{}", "no keys"), "bad.toml": ("[[keys]\n", "not valid TOML")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError) as e:
            KeyRing(str(tmp_path / name))
        assert str(e.value).startswith(f"--api-keys {tmp_path / name}: ") and message in str(e.value), str(e.value)


def test_reload_takes_new_keys_and_keeps_the_old_ones_on_a_bad_file(tmp_path):
    from router.api_keys import KeyRefused, KeyRing
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": KEYS["bob"], "tenant": "bob"}]}))
    ring = KeyRing(str(path))
    path.write_text(json.dumps({"keys": [{"key": KEYS["alice"], "tenant": "alice", "admin": True}]}))
    assert ring.reload()
    assert ring.authenticate(f"Bearer {KEYS['alice']}", admin_only=True).name == "alice"
    with pytest.raises(KeyRefused):
        ring.authenticate(f"Bearer {KEYS['bob']}")  # rotated out
    path.write_text("not json")
    assert not ring.reload()
    assert ring.authenticate(f"Bearer {KEYS['alice']}").name == "alice"


def test_local_cluster_with_keys_and_the_cli_clients(etcd_server, tmp_path):
    """`tandem up`'s cluster (real processes, mTLS) with --api-keys: tandem generate and explain
    send --api-key / TANDEM_API_KEY; explain needs an admin key."""
    import asyncio
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from cli.cluster import LocalCluster
    from engine.model_source import TINY

    keys = tmp_path / "keys.toml"
    keys.write_text(KEY_FILE)
    root = Path(__file__).resolve().parent.parent

    def tandem(*args: str, key: str | None = None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        env.update(TANDEM_TLS_CA=str(cluster.ca.ca_path), **({"TANDEM_API_KEY": key} if key else {}))
        return subprocess.run([sys.executable, "-m", "cli.main", *args, "--router", cluster.router_address],
                              cwd=root, capture_output=True, text=True, timeout=120, env=env)

    cluster = LocalCluster(model=TINY, etcd=etcd_server.endpoint, namespace="e2e-api-keys-up", api_keys=str(keys),
                           worker_args=["--num-blocks", "128"], log_dir=str(tmp_path / "logs"))
    asyncio.run(cluster.start())  # its readiness check itself needs the admin key
    try:
        ok = tandem("generate", "To be", "--max-tokens", "3", "--api-key", KEYS["bob"])
        assert ok.returncode == 0 and "[3 tokens" in ok.stderr, ok.stderr
        assert tandem("generate", "To be", "--max-tokens", "3", key=KEYS["bob"]).returncode == 0  # TANDEM_API_KEY
        missing = tandem("generate", "To be", "--max-tokens", "3")
        assert missing.returncode == 1 and "UNAUTHENTICATED" in missing.stderr, missing.stderr
        # tandem tokenize without --model: the ids of the model the router serves (tandem-tiny
        # here, whose ids differ from the workers' default model's), asked over TLS with the key
        from common.tokenizer import load_tokenizer
        from engine.model_source import DEFAULT_MODEL, load_config
        tiny_ids = load_tokenizer(load_config(TINY)[2]).encode(" love")
        assert tiny_ids != load_tokenizer(load_config(DEFAULT_MODEL)[2]).encode(" love")
        served = tandem("tokenize", " love", key=KEYS["bob"])
        assert served.returncode == 0 and json.loads(served.stdout) == tiny_ids, served.stderr
        assert "the model the router at" in served.stderr, served.stderr
        # a refused key is said, not papered over with the default model's ids
        unasked = tandem("tokenize", " love")
        assert unasked.returncode == 2 and "UNAUTHENTICATED" in unasked.stderr and "--api-key" in unasked.stderr, \
            unasked.stderr
        # so is a TLS handshake that fails (a CA of another cluster): not "no router", no default model's ids
        from common.certs import LocalCa
        other = LocalCa(tmp_path / "other-ca").ca_path
        stale = tandem("tokenize", " love", "--tls-ca", other, key=KEYS["bob"])
        assert stale.returncode == 2 and "TLS handshake" in stale.stderr and not stale.stdout, stale.stderr
        # tandem bench without a key: said at once (not after --router-wait), naming the flag
        started = time.monotonic()
        bench = tandem("bench", "--num-requests", "1", "--output-tokens", "2", "--router-wait", "60")
        assert bench.returncode == 1 and "UNAUTHENTICATED" in bench.stderr and "--api-key" in bench.stderr, bench.stderr
        assert time.monotonic() - started < 30, "bench waited out --router-wait"
        refused = tandem("explain", "To be", key=KEYS["bob"])
        assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
        explained = tandem("explain", "To be", key=KEYS["ops"])
        assert explained.returncode == 0 and explained.stdout.strip(), explained.stderr
        # Rotation: bob's key replaced by a new one, then SIGHUP; the router logs the reload.
        import signal
        new_key = "tk-bob-rotated-0123456789"
        keys.write_text(KEY_FILE.replace(KEYS["bob"], new_key))
        cluster.procs["router"].send_signal(signal.SIGHUP)
        log = cluster.log_dir / "router.log"
        deadline = time.monotonic() + 30
        while "reloaded 5 API keys" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        assert tandem("generate", "To be", "--max-tokens", "2", key=new_key).returncode == 0
        old = tandem("generate", "To be", "--max-tokens", "2", key=KEYS["bob"])
        assert old.returncode == 1 and "UNAUTHENTICATED" in old.stderr, old.stderr
    finally:
        asyncio.run(cluster.stop())
