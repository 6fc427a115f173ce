"""A throwaway PKI for the TLS tests: certificates signed by a test CA, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID


def certificate(subject: str, issuer_name: x509.Name, issuer_key, key, ca: bool = False) -> x509.Certificate:
    """A one-day certificate for ``key``; a leaf is valid for localhost and 127.0.0.1."""
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_pem(directory: Path, name: str, cert: x509.Certificate, key=None) -> tuple[str, str]:
    """Writes ``name.crt`` (and ``name.key`` when a key is given); returns both paths."""
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (directory / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                                  serialization.PrivateFormat.PKCS8,
                                                                  serialization.NoEncryption()))
    return str(directory / f"{name}.crt"), str(directory / f"{name}.key")
