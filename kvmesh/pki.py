"""A private CA and the certificates it signs, for kvmesh's mutual TLS (ECDSA P-256, SHA-256).

Shared by the compose deployment's ``secrets-init`` step (docker/init_secrets.py) and ``kvmesh up``'s local fleet
(kvmesh_apps/fleet_tls.py); each decides where the PEM files go and who owns them. Everything here is pure: keys and
certificates in, keys and certificates (or PEM text) out.

A certificate is *current* while its CA signed it, it names what it should and it is valid for more than
``RENEW_DAYS``: callers keep a current one and issue again otherwise (a new CA re-issues every certificate).
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_DAYS = 30  # a certificate valid for fewer days than this is issued again


@dataclass(frozen=True)
class Subject:
    """What a leaf certificate names: its common name and, for a server, the DNS names and IP addresses it
    answers on (its subject alternative names). A server's certificate is also valid as a client certificate."""

    name: str
    server: bool
    dns_names: tuple[str, ...] = ()
    ip_addresses: tuple[str, ...] = ()

    def alternative_names(self) -> list[x509.GeneralName]:
        if not self.server:
            return []
        return ([x509.DNSName(n) for n in self.dns_names]
                + [x509.IPAddress(ipaddress.ip_address(a)) for a in self.ip_addresses])


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate and private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def pem_key(key) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def fresh(cert: x509.Certificate) -> bool:
    return cert.not_valid_after_utc - _now() > datetime.timedelta(days=RENEW_DAYS)


def new_authority(label: str) -> Authority:
    """A new self-signed CA named ``<label> <random suffix>`` (two CAs made with one label differ by name)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{label} {secrets.token_hex(4)}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Authority(cert, key)


def load_authority(cert_pem: bytes, key_pem: bytes) -> Authority | None:
    """The CA in these PEM files if it is usable (its key matches, fresh), else None."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
    except (ValueError, TypeError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.public_key() != key.public_key() or not fresh(cert):
        return None
    return Authority(cert, key)


def is_current(cert_pem: bytes, key_pem: bytes, ca: Authority, subject: Subject) -> bool:
    """Whether ``cert_pem`` is signed by ``ca``, names exactly ``subject``, is fresh, and ``key_pem`` is its key
    (a crash between writing a new key and its certificate leaves a pair that is not current)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(ca.cert)
        key = serialization.load_pem_private_key(key_pem, None)
    except (ValueError, TypeError, InvalidSignature):
        return False
    try:
        sans = list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        sans = []
    return (fresh(cert) and cert.public_key() == key.public_key()
            and cert.subject.rfc4514_string() == f"CN={subject.name}" and sans == subject.alternative_names())


def issue(ca: Authority, subject: Subject) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and a certificate for it signed by ``ca`` (server: server and client auth; else client only)."""
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if subject.server else [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject.name)]))
               .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(_now() - datetime.timedelta(minutes=5))
               .not_valid_after(_now() + datetime.timedelta(days=LEAF_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                              critical=False))
    if subject.alternative_names():
        builder = builder.add_extension(x509.SubjectAlternativeName(subject.alternative_names()), critical=False)
    return builder.sign(ca.key, hashes.SHA256()), key
