"""deploy/k8s: every manifest is valid against the Kubernetes OpenAPI schema (kubernetes-validate,
strict: unknown fields fail; offline, the schemas ship in the package; cert-manager's own kinds
are checked here by hand), and the pieces agree: probes on the gRPC health service over mTLS,
each pod's certificate from the cluster CA's issuer naming its role and its pod as instance,
grace periods covering the drain budget, scrape annotations on real ports, and a ConfigMap that
the config loader accepts."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cli import config
from cli.main import build_parser
from router.main import RouterOptions

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
CERT_MANAGER = "cert-manager.io/v1"  # kinds the Kubernetes schema does not have (cert-manager's CRDs)
TLS_DIR = "/var/run/tandem/tls"
# grpc probes are GA since 1.27; check the oldest schema with them and the newest shipped.
VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
AFTER_DRAIN_S = 2 + 2 + 5  # as tests/test_deploy_systemd.py: deregistration, gRPC grace, margin


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[dict]:
    return [d for p in MANIFESTS for d in docs(p)]


def find(kind: str, name: str) -> dict:
    return next(d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_against_the_kubernetes_schema(path, version):
    for doc in docs(path):
        if doc["apiVersion"] != CERT_MANAGER:
            kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def test_the_cluster_ca_is_a_self_signed_certificate_behind_the_pods_issuer():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in all_docs() if d["apiVersion"] == CERT_MANAGER}
    assert kinds == {("Issuer", "tandem-selfsigned"), ("Certificate", "tandem-ca"), ("Issuer", "tandem-ca")}
    ca = find("Certificate", "tandem-ca")["spec"]
    assert ca["isCA"] and ca["issuerRef"]["name"] == "tandem-selfsigned"
    assert "selfSigned" in find("Issuer", "tandem-selfsigned")["spec"]
    assert find("Issuer", "tandem-ca")["spec"]["ca"]["secretName"] == ca["secretName"]


def _tls_volume(pod: dict) -> tuple[dict, dict]:
    """(the pod's csi.cert-manager.io volume's attributes, its container's mount of it)."""
    (container,) = pod["spec"]["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    (volume,) = [v for v in pod["spec"]["volumes"] if "csi" in v]
    assert volume["csi"]["driver"] == "csi.cert-manager.io" and volume["csi"]["readOnly"]
    return volume["csi"]["volumeAttributes"], mounts[volume["name"]]


@pytest.mark.parametrize("name", ["tandem-router", "tandem-prefill", "tandem-decode"])
def test_each_pod_has_its_own_certificate_naming_its_role_and_instance(name, tandem_config):
    pod = find("Deployment", name)["spec"]["template"]
    attrs, mount = _tls_volume(pod)
    role = name.removeprefix("tandem-")
    assert attrs["csi.cert-manager.io/issuer-name"] == "tandem-ca"
    assert attrs["csi.cert-manager.io/issuer-kind"] == "Issuer"
    # the worker registers under its certificate's instance name: one per pod (docs/security.md)
    want = [f"tandem://role/{role}", "tandem://instance/${POD_NAME}"]
    assert attrs["csi.cert-manager.io/uri-sans"].split(",") == want
    dns = attrs["csi.cert-manager.io/dns-names"].split(",")
    assert {"${POD_NAME}.instance.tandem.invalid", "*.${POD_NAME}.instance.tandem.invalid"} <= set(dns)
    assert "127.0.0.1" in attrs["csi.cert-manager.io/ip-sans"].split(",")  # the exec probes dial it
    assert {"server auth", "client auth"} <= set(attrs["csi.cert-manager.io/key-usages"].split(","))
    assert int(attrs["csi.cert-manager.io/fs-group"]) == pod["spec"]["securityContext"]["fsGroup"]
    assert mount["mountPath"] == TLS_DIR and mount["readOnly"]
    assert (tandem_config["tls_cert"], tandem_config["tls_key"], tandem_config["tls_ca"]) == (
        f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
    if role == "router":  # clients dial the Service
        assert "tandem-router.${POD_NAMESPACE}.svc" in dns


def test_etcd_takes_only_clients_and_peers_with_certificates_of_the_cluster_ca(tandem_config):
    pod = find("StatefulSet", "etcd")["spec"]["template"]
    attrs, mount = _tls_volume(pod)
    args = pod["spec"]["containers"][0]["args"]
    for flag in ("--client-cert-auth", "--peer-client-cert-auth", f"--trusted-ca-file={TLS_DIR}/ca.crt",
                 f"--peer-trusted-ca-file={TLS_DIR}/ca.crt", f"--cert-file={TLS_DIR}/tls.crt"):
        assert flag in args, flag
    assert all(a.split("=", 1)[1].startswith("https://") for a in args if a.split("=")[0].endswith("-urls")
               and "metrics" not in a)
    host = tandem_config["etcd"].removeprefix("https://").split(":")[0]
    assert tandem_config["etcd"].startswith("https://") and host in attrs["csi.cert-manager.io/dns-names"].split(",")
    assert mount["mountPath"] == TLS_DIR


def test_validation_can_fail():
    bad = find("Deployment", "tandem-decode")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"] = "tandem health"  # a list
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = find("Deployment", "tandem-router")
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 20  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


@pytest.fixture(scope="module")
def tandem_config(tmp_path_factory) -> dict:
    """The ConfigMap's tandem.toml, through the same loader (unknown keys and wrong types fail)."""
    path = tmp_path_factory.mktemp("k8s") / "tandem.toml"
    path.write_text(find("ConfigMap", "tandem-config")["data"]["tandem.toml"])
    return config.load_file(str(path), config.Schema.of(build_parser()))


@pytest.mark.parametrize("name", ["tandem-router", "tandem-prefill", "tandem-decode"])
def test_tandem_pods_probe_grpc_health_and_mount_the_config(name, tandem_config):
    pod = find("Deployment", name)["spec"]["template"]
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    data = tandem_config
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == data["port"]
    # kubelet's own grpc probes speak plaintext, which an mTLS server refuses: `tandem health`
    # with the pod's certificate checks the same grpc.health.v1 status
    health = ["tandem", "health", f"127.0.0.1:{ports['grpc']}", "--tls-cert", f"{TLS_DIR}/tls.crt",
              "--tls-key", f"{TLS_DIR}/tls.key", "--tls-ca", f"{TLS_DIR}/ca.crt"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # a router is ready while its front serves (a decode worker healthy), alive while its process does
        want = health[:3] + ["--service", "tandem.v1.FrontendService"] + health[3:] \
            if probe == "readinessProbe" and name == "tandem-router" else health
        assert container[probe]["exec"]["command"] == want, probe
        assert container[probe]["timeoutSeconds"] >= 5, probe  # a Python process per probe
    env = {e["name"]: e for e in container["env"]}
    assert env["TANDEM_CONFIG"]["value"] == "/etc/tandem/tandem.toml"
    assert env["TANDEM_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["args"] == [name.removeprefix("tandem-")]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"] == int(env["TANDEM_METRICS_PORT"]["value"])
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/etc/tandem"]]["configMap"]["name"] == "tandem-config"


@pytest.mark.parametrize("name", ["tandem-prefill", "tandem-decode"])
def test_worker_grace_period_covers_the_drain(name, tandem_config):
    spec = find("Deployment", name)["spec"]["template"]["spec"]
    drain_s = tandem_config["worker"]["drain_timeout_s"]
    assert spec["terminationGracePeriodSeconds"] >= drain_s + AFTER_DRAIN_S
    assert "lifecycle" not in spec["containers"][0]  # the drain starts on SIGTERM; see the manifest


def test_router_grace_period_covers_its_prestop_sleep_and_drain(tandem_config):
    spec = find("Deployment", "tandem-router")["spec"]["template"]["spec"]
    sleep = spec["containers"][0]["lifecycle"]["preStop"]
    sleep_s = float((sleep.get("sleep") or {}).get("seconds") or sleep["exec"]["command"][-1])
    drain_s = tandem_config.get("router", {}).get("drain_timeout_s", RouterOptions(etcd="127.0.0.1:2379").drain_timeout_s)
    assert spec["terminationGracePeriodSeconds"] >= sleep_s + drain_s + AFTER_DRAIN_S


def test_router_service_and_etcd_endpoint_agree(tandem_config):
    service = find("Service", "tandem-router")
    router = find("Deployment", "tandem-router")["spec"]["template"]
    assert service["spec"]["selector"].items() <= router["metadata"]["labels"].items()
    spec = router["spec"]
    sleep_s = int(spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] >= sleep_s + AFTER_DRAIN_S
    host, port = tandem_config["etcd"].removeprefix("https://").split(":")
    etcd_service = find("Service", host)
    assert int(port) in [p["port"] for p in etcd_service["spec"]["ports"]]
    etcd = find("StatefulSet", host)
    assert etcd["spec"]["serviceName"] == host
    assert etcd_service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()


def test_router_serves_the_http_api_through_its_service():
    pod = find("Deployment", "tandem-router")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(env["TANDEM_HTTP_PORT"]["value"])
    service = {p["name"]: p for p in find("Service", "tandem-router")["spec"]["ports"]}
    assert service["http"]["targetPort"] == "http"
