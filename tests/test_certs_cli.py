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
from common.tls import INSTANCE_URI, ROLE_URI, TlsFiles


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
    assert uris == {ROLE_URI + "decode", INSTANCE_URI + "decode-0"}  # NAME is the worker's instance id
    assert {"10.0.0.7", "decode-a.internal", "192.0.2.10", "127.0.0.1", "localhost"} <= hosts
    assert sans(out / "mock.pem")[0] == {ROLE_URI + "decode", ROLE_URI + "prefill", INSTANCE_URI + "mock"}
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
    ("x:decode@", "empty host"),
    ("x:decode@10.0.0.7,", "empty host"),
])
def test_bad_entries_are_refused_naming_them(entry, message, tmp_path, capsys):
    with pytest.raises(ValueError, match=message):
        parse_entry(entry)
    assert main(["certs", str(tmp_path / "tls"), entry]) == 2
    assert entry in capsys.readouterr().err
    assert not (tmp_path / "tls").exists()  # nothing made


@pytest.mark.parametrize("entries,named", [
    (["a:decode", "a-key:router"], "a-key"),  # a-key.pem would overwrite a's key
    (["a-key:router", "a:decode"], "a-key"),
    (["dup:decode", "dup:router"], "dup"),  # the second would replace the first
    (["x:decode@h\u00e9llo"], "h\u00e9llo"),  # not a DNS name (an A-label) nor an IP address
    (["x:decode@10.0.0.1 "], "10.0.0.1 "),
])
def test_entries_that_would_clash_or_cannot_be_named_are_refused_before_anything_is_made(entries, named,
                                                                                          tmp_path, capsys):
    assert main(["certs", str(tmp_path / "tls"), *entries]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "tls").exists()


@pytest.mark.parametrize("host", ["h\u00e9llo", "a b"])
def test_a_bad_host_flag_is_refused_before_anything_is_made(host, tmp_path, capsys):
    assert main(["certs", str(tmp_path / "tls"), "a:decode", "--host", host]) == 2
    assert repr(host) in capsys.readouterr().err
    assert not (tmp_path / "tls").exists()


def test_days_beyond_what_a_certificate_can_say_are_refused(tmp_path, capsys):
    assert main(["certs", str(tmp_path / "tls"), "a:decode", "--days", "99999999"]) == 2
    assert "--days" in capsys.readouterr().err
    assert not (tmp_path / "tls").exists()


def test_a_reused_ca_whose_key_is_not_its_own_is_refused(tmp_path, capsys):
    """docs/deploy.md moves ca-key.pem off the host and has it put back for a later run: the
    wrong key back would sign certificates nobody accepts, so the run stops instead."""
    out, other = tmp_path / "tls", tmp_path / "other"
    assert main(["certs", str(out), "a:decode"]) == 0
    assert main(["certs", str(other), "b:decode"]) == 0
    (out / "ca-key.pem").write_bytes((other / "ca-key.pem").read_bytes())
    capsys.readouterr()
    assert main(["certs", str(out), "c:decode"]) == 2
    assert "ca-key.pem" in capsys.readouterr().err
    assert not (out / "c.pem").exists()
    (out / "ca-key.pem").unlink()
    assert main(["certs", str(out), "c:decode"]) == 2  # missing: named, no traceback
    assert "ca-key.pem" in capsys.readouterr().err
    assert not (out / "c.pem").exists()


def test_keys_are_never_readable_by_others_not_even_while_written(tmp_path, monkeypatch):
    """A key file is created mode 0600, not written with the umask's mode and narrowed after
    (another local user could open it in between and read it from then on)."""
    import os
    from pathlib import Path

    from common.certs import LocalCa
    monkeypatch.setattr(Path, "chmod", lambda self, mode: None)  # only the mode it was created with
    old = os.umask(0o022)
    try:
        LocalCa(tmp_path).issue("a", ("decode",))
    finally:
        os.umask(old)
    for key in ("ca-key.pem", "a-key.pem"):
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600, key


def test_a_ca_key_without_its_certificate_is_not_replaced(tmp_path, capsys):
    """ca.pem gone but ca-key.pem there: a new CA would overwrite the old key, and with it every
    later certificate of the old CA; the run stops and names both files instead."""
    out = tmp_path / "tls"
    assert main(["certs", str(out), "a:decode"]) == 0
    key = (out / "ca-key.pem").read_bytes()
    (out / "ca.pem").unlink()
    capsys.readouterr()
    assert main(["certs", str(out), "b:decode"]) == 2
    err = capsys.readouterr().err
    assert "ca-key.pem exists" in err and "ca.pem" in err and "Traceback" not in err
    assert (out / "ca-key.pem").read_bytes() == key and not (out / "b.pem").exists()
