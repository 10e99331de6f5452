"""Test certificates made on the spot: a CA, server and client certificates it signs, and a stranger CA.

Made with ``cryptography`` (a product dependency, appliance/keys/tls.py); EC P-256 keys, so making them costs
milliseconds. Nothing here is a fixture: callers pick the directory (a unit's files must not live under /tmp).
"""
from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: Path
    key: Path

    def fingerprint(self) -> bytes:
        return x509.load_pem_x509_certificate(self.cert.read_bytes()).fingerprint(hashes.SHA256())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(d: Path, stem: str, cert: x509.Certificate, key) -> Issued:
    d.mkdir(parents=True, exist_ok=True)
    c, k = d / f"{stem}.pem", d / f"{stem}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    k.chmod(0o600)
    return Issued(c, k)


class CA:
    """A test certificate authority; ``issue`` signs server or client certificates."""

    def __init__(self, d: Path, name: str = "pdctl test CA"):
        self.dir = Path(d)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=3650))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.files = _write(self.dir, name.replace(" ", "-"), self.cert, self.key)

    @property
    def pem(self) -> Path:
        return self.files.cert

    def issue(self, stem: str, cn: str = "localhost", client: bool = False, days: float = 365,
              not_before_days: float = -1) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now + dt.timedelta(days=not_before_days)).not_valid_after(now + dt.timedelta(days=days))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                   else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        if not client:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return _write(self.dir, stem, b.sign(self.key, hashes.SHA256()), key)
