"""A certificate authority with the `cryptography` package: one CA and one certificate per
process, each naming its roles (common/tls.py ROLE_URI) and the host names it is dialled at.
Throw-away for a local cluster (`tandem up`, the tests: 7 days, loopback names), or kept for a
deployment (`tandem certs`, cli/certs.py: the validity and hosts given)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from common.tls import INSTANCE_DNS, INSTANCE_URI, ROLE_URI, TlsFiles

LOOPBACK = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 7  # a local cluster's certificates; each `tandem up` makes new ones


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    if not private:
        path.write_bytes(data)
        return
    # created 0600, never readable by others in between (an existing file is narrowed first)
    if path.exists():
        path.chmod(0o600)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(0o600)


class LocalCa:
    """A CA whose files live in `folder` (ca.pem, ca-key.pem): a new one, or with `reuse` the
    one already there (made by an earlier run); `issue` writes NAME.pem and NAME-key.pem beside
    them, valid `days` days."""

    def __init__(self, folder: str | Path, name: str = "tandem local CA", days: int = VALID_DAYS,
                 reuse: bool = False) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import NameOID

        self.folder = Path(folder)
        self.days = days
        self.ca_path = self.folder / "ca.pem"
        if reuse and self.ca_path.exists():
            key_path = self.folder / "ca-key.pem"
            if not key_path.exists():
                raise ValueError(f"{key_path} is missing: put the CA's key back beside {self.ca_path} to issue "
                                 "certificates of that CA (or use a new folder for a new CA)")
            self._cert = x509.load_pem_x509_certificate(self.ca_path.read_bytes())
            self._key = serialization.load_pem_private_key(key_path.read_bytes(), None)
            pem = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            if self._key.public_key().public_bytes(*pem) != self._cert.public_key().public_bytes(*pem):
                raise ValueError(f"{key_path} is not the key of {self.ca_path}: certificates it signed would "
                                 "not verify against that CA")
            return
        if reuse and (self.folder / "ca-key.pem").exists():  # a key without its certificate: not ours to replace
            raise ValueError(f"{self.folder / 'ca-key.pem'} exists but {self.ca_path} does not: put the CA's "
                             "certificate back beside its key (or use a new folder for a new CA)")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5))
                      .not_valid_after(now + datetime.timedelta(days=days))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        _write(self.ca_path, self._cert.public_bytes(serialization.Encoding.PEM))
        _write(self.folder / "ca-key.pem", _pem_key(self._key), private=True)

    def issue(self, name: str, roles: tuple[str, ...], hosts: tuple[str, ...] = LOOPBACK) -> TlsFiles:
        """A certificate for one process (server and client use), CN = name, a URI SAN per role,
        one for its instance (INSTANCE_URI + name: a worker holding it registers as instance
        `name`; also as the DNS names name + INSTANCE_DNS and *.name + INSTANCE_DNS, which
        clients check) and a DNS or IP SAN per host; returns its files with the CA's."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = _key()
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(ROLE_URI + r) for r in roles]
        sans.append(x509.UniformResourceIdentifier(INSTANCE_URI + name))
        # the same instance as DNS names, checked by clients dialling its record (tls.instance_server_name)
        sans += [x509.DNSName(name + INSTANCE_DNS), x509.DNSName("*." + name + INSTANCE_DNS)]
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(min(now + datetime.timedelta(days=self.days), self._cert.not_valid_after_utc))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        cert_path, key_path = self.folder / f"{name}.pem", self.folder / f"{name}-key.pem"
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        _write(key_path, _pem_key(key), private=True)
        return TlsFiles(str(cert_path), str(key_path), str(self.ca_path))
