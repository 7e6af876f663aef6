"""TLS for the bus: a private CA, a server certificate for nats-server and a client
certificate for services (mutual TLS), written by ``tokenbus nats-config --tls``, and the
client side's SSL context.

Files (PEM, private keys mode 0600) are kept once written, like the role passwords: running
``nats-config`` again does not invalidate certificates that services already trust. The
server certificate names ``localhost``, ``127.0.0.1``, this host's name and every name given
with ``--tls-name``; a client connecting by another name fails the hostname check.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import socket
import ssl
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Written beside ``nats-users.json``: where the bus's TLS files are, for role_env.
TLS_FILE = "tls.json"
_DAYS = 825  # the longest validity Apple and browsers accept for a server certificate


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of a TLS bus. ``client_*``: the certificate services present (absent
    when the operator brought their own server certificate and CA)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str = ""
    client_key: str = ""
    verify: bool = False  # every connection must present a certificate the CA signed

    def save(self, folder: Path) -> None:
        (folder / TLS_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> TlsFiles | None:
        path = folder / TLS_FILE
        return cls(**json.loads(path.read_text())) if path.exists() else None

    def server_block(self) -> str:
        """The ``tls { }`` block of nats.conf."""
        verify = "true" if self.verify else "false"
        return (
            "tls {\n"
            f"  cert_file: {json.dumps(self.server_cert)}\n"
            f"  key_file: {json.dumps(self.server_key)}\n"
            f"  ca_file: {json.dumps(self.ca)}\n"
            f"  verify: {verify}\n"
            "  timeout: 2\n"
            "}\n"
        )


def client_context(ca: str, cert: str = "", key: str = "") -> ssl.SSLContext:
    """A client SSL context trusting ``ca`` (and presenting ``cert``/``key`` when given)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key or None)
    return ctx


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (mode 0600, an existing file's
    included: the mode is set before anything is written)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fd, 0o600)
        fh.write(data.encode() if isinstance(data, str) else data)


def generate(folder: Path, names: list[str], *, verify: bool = False) -> TlsFiles:
    """A CA, a server certificate for ``names`` (plus localhost, 127.0.0.1 and this host)
    and a client certificate, in ``folder``; what exists already is kept."""
    # Imported here: only `nats-config --tls` needs it (a few MB, not on the request path).
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(
        ca=str(folder / "ca.pem"),
        server_cert=str(folder / "server.pem"),
        server_key=str(folder / "server-key.pem"),
        client_cert=str(folder / "client.pem"),
        client_key=str(folder / "client-key.pem"),
        verify=verify,
    )
    if all(Path(p).exists() for p in (files.ca, files.server_cert, files.client_cert)):
        return files
    now = dt.datetime.now(dt.UTC)

    def key_pem(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def name(cn: str) -> x509.Name:
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tokenbus"),
                x509.NameAttribute(NameOID.COMMON_NAME, cn),
            ]
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("tokenbus bus CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
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
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage: x509.ObjectIdentifier, alt: list[x509.GeneralName]) -> tuple[Any, Any]:
        k = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_name)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if alt:
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return k, b.sign(ca_key, hashes.SHA256())

    alt: list[x509.GeneralName] = []
    for n in dict.fromkeys(["localhost", "127.0.0.1", socket.gethostname(), *names]):
        if not n or n in ("0.0.0.0", "::"):
            continue
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    srv_key, srv_cert = leaf("nats-server", ExtendedKeyUsageOID.SERVER_AUTH, alt)
    cli_key, cli_cert = leaf("tokenbus service", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    pem = serialization.Encoding.PEM
    Path(files.ca).write_bytes(ca_cert.public_bytes(pem))
    write_private(folder / "ca-key.pem", key_pem(ca_key))
    Path(files.server_cert).write_bytes(srv_cert.public_bytes(pem))
    write_private(Path(files.server_key), key_pem(srv_key))
    Path(files.client_cert).write_bytes(cli_cert.public_bytes(pem))
    write_private(Path(files.client_key), key_pem(cli_key))
    return files
