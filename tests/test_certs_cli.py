"""`tandem certs` (cli/certs.py): a CA and one certificate per process for a deployment, the CA
reused by later runs, roles and hosts as subject alternative names, keys private, bad entries
refused with the entry named."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509

from cli.certs import parse_entry
from cli.main import main
from common.tls import ROLE_URI, TlsFiles


def sans(path) -> tuple[set[str], set[str]]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = set(ext.get_values_for_type(x509.UniformResourceIdentifier))
    hosts = set(ext.get_values_for_type(x509.DNSName)) | {str(ip) for ip in ext.get_values_for_type(x509.IPAddress)}
    return uris, hosts


def test_certs_for_a_deployment_and_a_later_host(tmp_path, capsys):
    out = tmp_path / "tls"
    assert main(["certs", str(out), "router-0:router", "decode-0:decode@10.0.0.7,decode-a.internal",
                 "mock:decode+prefill", "etcd:etcd", "--host", "192.0.2.10", "--days", "30"]) == 0
    assert "router-0.pem" in capsys.readouterr().out
    ca = (out / "ca.pem").read_bytes()
    uris, hosts = sans(out / "decode-0.pem")
    assert uris == {ROLE_URI + "decode"}
    assert {"10.0.0.7", "decode-a.internal", "192.0.2.10", "127.0.0.1", "localhost"} <= hosts
    assert sans(out / "mock.pem")[0] == {ROLE_URI + "decode", ROLE_URI + "prefill"}
    assert "10.0.0.7" not in sans(out / "router-0.pem")[1]  # an entry's own hosts are its own
    for key in ("ca-key.pem", "decode-0-key.pem", "etcd-key.pem"):
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((out / "decode-0.pem").read_bytes())
    assert 29 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 31
    # A later run on the folder issues from the same CA.
    assert main(["certs", str(out), "prefill-1:prefill@10.0.0.8"]) == 0
    assert (out / "ca.pem").read_bytes() == ca
    ca_cert = x509.load_pem_x509_certificate(ca)
    later = x509.load_pem_x509_certificate((out / "prefill-1.pem").read_bytes())
    later.verify_directly_issued_by(ca_cert)
    assert ipaddress.ip_address("10.0.0.8") in later.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)
    TlsFiles(str(out / "prefill-1.pem"), str(out / "prefill-1-key.pem"), str(out / "ca.pem")).load()


@pytest.mark.parametrize("entry,message", [
    ("decode-0", "expected NAME:ROLE"),
    ("decode-0:wizard", "unknown role 'wizard'"),
    ("../x:decode", "plain file name"),
    ("ca:router", "plain file name"),
])
def test_bad_entries_are_refused_naming_them(entry, message, tmp_path, capsys):
    with pytest.raises(ValueError, match=message):
        parse_entry(entry)
    assert main(["certs", str(tmp_path / "tls"), entry]) == 2
    assert entry in capsys.readouterr().err
    assert not (tmp_path / "tls").exists()  # nothing made
