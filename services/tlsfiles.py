"""TLS for the bus: a private CA, a server certificate for nats-server and a client
certificate for services (mutual TLS), written by ``tokenbus nats-config --tls``, and the
client side's SSL context.

Files (PEM, private keys mode 0600) are kept once written, like the role passwords: running
``nats-config`` again does not invalidate certificates that services already trust. The
server certificate names ``localhost``, ``127.0.0.1``, this host's name and every name given
with ``--tls-name``; a client connecting by another name fails the hostname check.
"""

from __future__ import annotations

import contextlib
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

    def route_block(self) -> str:
        """The ``tls { }`` block of a ``cluster { }``: routes between the nodes encrypted,
        each node checking the one it dials against the CA (the server certificate names
        every node); the route password authenticates them."""
        return (
            "  tls {\n"
            f"    cert_file: {json.dumps(self.server_cert)}\n"
            f"    key_file: {json.dumps(self.server_key)}\n"
            f"    ca_file: {json.dumps(self.ca)}\n"
            "    timeout: 2\n"
            "  }\n"
        )


def client_context(ca: str, cert: str = "", key: str = "") -> ssl.SSLContext:
    """A client SSL context trusting ``ca`` (and presenting ``cert``/``key`` when given)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key or None)
    return ctx


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (mode 0600, set before anything
    is written), all at once: it is written beside ``path`` and renamed over it, so a reader
    never finds the file empty or half written (a script, or a test, that reads `tokenbus
    up`'s key the moment the file appears)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fd, 0o600)
            fh.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


RENEW_WITHIN_DAYS = 30  # a leaf certificate that expires sooner is issued again


def generate(
    folder: Path, names: list[str], *, verify: bool = False, renew: bool = False
) -> TlsFiles:
    """A CA, a server certificate for ``names`` (plus localhost, 127.0.0.1 and this host)
    and a client certificate, in ``folder``. The CA is kept once made (clients trust it);
    the server and client certificates are kept too, unless one is missing, expires within
    :data:`RENEW_WITHIN_DAYS`, is a server certificate that cannot serve a cluster route
    (routes are mutual TLS: it needs client use as well), or ``renew`` asks: then it is
    issued again by the same CA, so a node reloaded with it is trusted by every client
    and every other node at once."""
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
    now = dt.datetime.now(dt.UTC)
    pem = serialization.Encoding.PEM
    ca_key_path = folder / "ca-key.pem"

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

    def current(path: str, usages: set[Any]) -> bool:
        """Whether the certificate at ``path`` can stay: there, not expiring soon, for
        ``usages``."""
        if renew or not Path(path).exists():
            return False
        cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
        if cert.not_valid_after_utc - now < dt.timedelta(days=RENEW_WITHIN_DAYS):
            return False
        try:
            eku = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        except x509.ExtensionNotFound:
            return True
        return usages <= eku

    server_use = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    client_use = {ExtendedKeyUsageOID.CLIENT_AUTH}
    has_ca = Path(files.ca).exists()
    if has_ca and current(files.server_cert, server_use) and current(files.client_cert, client_use):
        return files
    if has_ca and not ca_key_path.exists():
        return files  # an operator's CA without its key: theirs to renew
    if has_ca:
        ca_cert = x509.load_pem_x509_certificate(Path(files.ca).read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        ca_key = loaded
        ca_name = ca_cert.subject
    else:
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
        Path(files.ca).write_bytes(ca_cert.public_bytes(pem))
        write_private(ca_key_path, key_pem(ca_key))

    def leaf(cn: str, usage: list[Any], alt: list[x509.GeneralName]) -> tuple[Any, Any]:
        k = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_name)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=_DAYS), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
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
    if not current(files.server_cert, server_use):
        srv_key, srv_cert = leaf(
            "nats-server",
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            alt,
        )
        # The key first: a node reading the pair meanwhile never pairs a new cert with an
        # old key for long (a reload reads both again).
        write_private(Path(files.server_key), key_pem(srv_key))
        Path(files.server_cert).write_bytes(srv_cert.public_bytes(pem))
    if not current(files.client_cert, client_use):
        cli_key, cli_cert = leaf("tokenbus service", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
        write_private(Path(files.client_key), key_pem(cli_key))
        Path(files.client_cert).write_bytes(cli_cert.public_bytes(pem))
    return files
