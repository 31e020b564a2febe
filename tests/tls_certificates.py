"""Certificates for the tests' TLS servers: a CA of a test's own and a server certificate it
signed, written to a folder. Importable from every test folder, as ``child_process`` is."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class Certificates(NamedTuple):
    """PEM files: the CA's certificate, the server's certificate and its unencrypted key."""

    ca: Path
    cert: Path
    key: Path


def issue_certificates(
    folder: Path, names: Sequence[x509.GeneralName], *, ca_name: str, server_name: str
) -> Certificates:
    """A CA called ``ca_name``, and a certificate it signed for the server ``server_name`` valid
    for ``names`` only, written to ``folder`` (``ca.pem``, ``server.pem``, ``server.key``).

    Both carry the key usage and key identifiers a strict verifier asks for (Python 3.13's
    default ``VERIFY_X509_STRICT``); each is valid from five minutes ago for an hour.
    """
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .issuer_name(ca_subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
        .issuer_name(ca_subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    issued = Certificates(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    issued.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    issued.cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    issued.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return issued
