"""A throwaway CA, a server certificate for 127.0.0.1/localhost, and a client certificate (PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _issue(ca_key, ca_name: x509.Name, cn: str, usage, sans=None):  # noqa: ANN001, ANN202
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_tls_files(folder: Path) -> TlsFiles:
    """Write ca.pem, server.pem/-key.pem (127.0.0.1, localhost) and client.pem/-key.pem into ``folder``."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(_name("loraplex test CA")).issuer_name(_name("loraplex test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, server = _issue(ca_key, ca.subject, "localhost", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_key, client = _issue(ca_key, ca.subject, "tenant-a", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem", folder / "client.pem",
                     folder / "client-key.pem")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files.client_cert.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    _write_key(server_key, files.server_key)
    _write_key(client_key, files.client_key)
    return files
