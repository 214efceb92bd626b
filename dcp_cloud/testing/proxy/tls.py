"""A throwaway certificate authority and a server certificate for 127.0.0.1, for HTTPS in tests and benchmarks.

:func:`make_test_tls` writes a self-signed CA and a server certificate signed
by it (valid for ``127.0.0.1`` and ``localhost``, one day) into a directory;
:func:`server_context` turns them into the ``ssl_context`` of a
:class:`~dcp_cloud.testing.proxy.FaultProxy`. Clients trust the CA through
``TLSFiles.ca_file`` (boto3: ``AWS_CA_BUNDLE``; OpenSSL-based clients:
``SSL_CERT_FILE``). Needs the ``cryptography`` package (a dependency of moto).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TLSFiles:
    """PEM files written by :func:`make_test_tls`."""

    #: The CA certificate: what clients must trust.
    ca_file: str
    #: The server certificate followed by the CA (the chain the server sends).
    cert_file: str
    #: The server's private key (unencrypted).
    key_file: str


def make_test_tls(directory: str, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TLSFiles:
    """Write a fresh CA and a server certificate for ``hosts`` into ``directory``; return their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dcp_cloud test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = TLSFiles(
        ca_file=os.path.join(directory, "ca.pem"),
        cert_file=os.path.join(directory, "server.pem"),
        key_file=os.path.join(directory, "server.key"),
    )
    with open(files.ca_file, "wb") as fh:
        fh.write(ca_cert.public_bytes(pem))
    with open(files.cert_file, "wb") as fh:
        fh.write(cert.public_bytes(pem) + ca_cert.public_bytes(pem))
    fd = os.open(files.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2+) presenting ``files``' certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert_file, files.key_file)
    return ctx
