"""TLS on the bus (``tokenbus nats-config --tls``) and HTTPS on the bridge: a real
nats-server on the generated config, real service processes, real clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
import pytest
from cryptography import x509

from auth.store import KeyStore
from services import tlsfiles
from services.natsconf import generate, role_env, role_login
from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port, wait_port
from tests.support.procs import Procs, start_stack
from tests.support.repo import run_cli
from tokenbus import Client

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "over tls"}]


class TlsBus:
    """nats-server on ``nats-config --callout --tls`` output."""

    def __init__(self, folder: Path, *, verify: bool = False) -> None:
        self.port = free_port()
        self.tls = tlsfiles.generate(folder / "tls", [], verify=verify)
        self.conf, self.users = generate(folder, port=self.port, callout=True, tls=self.tls)
        self.proc = spawn_nats(self.port, "-c", str(self.conf))
        self.url = f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[TlsBus]:
    b = TlsBus(tmp_path / "locked")
    yield b
    b.stop()


def test_nats_config_tls_writes_the_certificates_once(tmp_path: Path) -> None:
    out = tmp_path / "conf"
    run_cli("nats-config", "--out", str(out), "--tls", "--tls-name", "bus.internal")
    tls = json.loads((out / "tls.json").read_text())
    assert "tls {" in (out / "nats.conf").read_text()
    for key in ("ca-key.pem", "server-key.pem", "client-key.pem"):
        assert (out / "tls" / key).stat().st_mode & 0o777 == 0o600
    ca = Path(tls["ca"]).read_bytes()
    # The server certificate names what clients dial: this host, loopback, --tls-name.
    cert = x509.load_pem_x509_certificate(Path(tls["server_cert"]).read_bytes())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(alt.get_values_for_type(x509.DNSName))
    assert {"localhost", "bus.internal", socket.gethostname()} <= names
    assert [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    # A second run keeps every file.
    run_cli("nats-config", "--out", str(out), "--tls")
    assert Path(tls["ca"]).read_bytes() == ca
    # Without --tls the config is plain again and services are not told to use TLS.
    run_cli("nats-config", "--out", str(out))
    assert "tls {" not in (out / "nats.conf").read_text()
    assert "TOKENBUS_NATS_TLS_CA" not in role_env(out / "nats-users.json", "worker")


def test_nats_config_refuses_half_given_certificates(tmp_path: Path) -> None:
    out = run_cli(
        "nats-config", "--out", str(tmp_path), "--tls", "--tls-cert", "x.pem", check=False
    )
    assert out.returncode == 2 and "--tls-key" in out.stderr
    out = run_cli("nats-config", "--out", str(tmp_path), "--tls-verify", check=False)
    assert out.returncode == 2 and "go with --tls" in out.stderr


async def test_a_stack_on_a_tls_bus_serves_and_plain_connections_are_refused(
    bus: TlsBus, tmp_path: Path
) -> None:
    model = "tls-model"
    with Procs(bus.url, tmp_path) as procs:
        await start_stack(
            procs,
            model,
            "ingress",
            "auth",
            "router",
            bridge=False,
            env={"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]'},
            env_for=lambda role, _: role_env(bus.users, role),
            login=role_login(bus.users, "admin"),
        )
        admin = await nats.connect(bus.url, **role_login(bus.users, "admin"))
        assert admin.connected_url is not None and admin._server_info.get("tls_required")
        store = await KeyStore(admin).open(watch=False)
        key, _ = await store.create("tls-tenant")
        out = None
        for _ in range(60):  # the auth service learns of the key, the replica beats
            with contextlib.suppress(Exception):
                async with await Client.connect(bus.url, api_key=key, tls_ca=bus.tls.ca) as tb:
                    out = await tb.chat_completion(model, MSG, max_tokens=6, timeout=5)
                    break
            await asyncio.sleep(0.3)
        assert out is not None and out.usage.completion_tokens == 6
        await admin.drain()
        # A client that does not trust the bus's CA fails the handshake, with the right key.
        with pytest.raises(ssl.SSLCertVerificationError):
            await nats.connect(bus.url, token=key, allow_reconnect=False, connect_timeout=3)
        # Plain text is refused by the server itself, good credentials or not: it closes
        # the connection instead of answering the PING.
        reply = await _plain_connect(bus.port, role_login(bus.users, "admin"))
        assert "PONG" not in reply and "+OK" not in reply
        # A service not given the CA says so and exits instead of retrying forever.
        env = {k: v for k, v in role_env(bus.users, "ingress").items() if "TLS" not in k}
        p = procs.start("ingress-no-tls", "serve", "ingress", env=env)
        code = await asyncio.to_thread(p.proc.wait, 15)
        assert code == 2, p.output()[-2000:]
        assert "TOKENBUS_NATS_TLS_CA" in p.output()


async def _plain_connect(port: int, login: dict[str, Any]) -> str:
    """What the server answers a plain-text CONNECT + PING, until it closes the connection."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        info = json.loads((await r.readline()).decode().removeprefix("INFO "))
        assert info["tls_required"] is True
        creds = {"verbose": False, "user": login["user"], "pass": login["password"]}
        w.write(b"CONNECT " + json.dumps(creds).encode() + b"\r\nPING\r\n")
        await w.drain()
        return (await asyncio.wait_for(r.read(), 5)).decode(errors="replace")
    finally:
        w.close()


async def test_mutual_tls_wants_a_certificate_from_every_connection(tmp_path: Path) -> None:
    bus = TlsBus(tmp_path / "locked", verify=True)
    try:
        # Services present the client certificate role_env/role_login name.
        assert role_env(bus.users, "worker")["TOKENBUS_NATS_TLS_CERT"] == bus.tls.client_cert
        nc = await nats.connect(bus.url, **role_login(bus.users, "admin"))
        assert nc.is_connected
        await nc.close()
        # Trusting the CA is not enough without a certificate of one's own.
        login = role_login(bus.users, "admin")
        login["tls"] = tlsfiles.client_context(bus.tls.ca)
        with pytest.raises(Exception):  # noqa: B017 - the server closes during the handshake
            nc = await nats.connect(bus.url, allow_reconnect=False, connect_timeout=3, **login)
            await nc.flush(timeout=2)
    finally:
        bus.stop()


async def test_the_bridge_serves_https(bus: TlsBus, tmp_path: Path) -> None:
    model = "https-model"
    port = free_port()
    with Procs(bus.url, tmp_path) as procs:
        await start_stack(
            procs,
            model,
            "ingress",
            "auth",
            "router",
            bridge=False,
            env={"TOKENBUS_INGRESS__PIPELINE": '["route"]'},
            env_for=lambda role, _: role_env(bus.users, role),
            login=role_login(bus.users, "admin"),
        )
        procs.start(
            "bridge",
            "serve",
            "bridge",
            "--port",
            str(port),
            "--tls-cert",
            bus.tls.server_cert,
            "--tls-key",
            bus.tls.server_key,
            # On the locked bus the bridge hands requests to the router service by itself.
            env={**role_env(bus.users, "bridge"), "TOKENBUS_INGRESS__PIPELINE": '["route"]'},
        )
        wait_port(port)
        ctx = tlsfiles.client_context(bus.tls.ca)
        base = f"https://127.0.0.1:{port}"
        async with httpx.AsyncClient(verify=ctx, timeout=10) as http:
            for _ in range(100):
                r = await http.get(f"{base}/ready")
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.2)
            assert r.status_code == 200
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http)
            out = None
            for _ in range(30):  # until the bridge has heard the replica
                with contextlib.suppress(openai.APIStatusError):
                    out = await oai.chat.completions.create(
                        model=model,
                        messages=MSG,  # type: ignore[arg-type]
                        max_tokens=5,
                    )
                    break
                await asyncio.sleep(0.3)
            assert out is not None and out.usage is not None
            assert out.usage.completion_tokens == 5
        # Plain HTTP on the HTTPS port gets no answer of ours.
        async with httpx.AsyncClient(timeout=5) as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"http://127.0.0.1:{port}/ready")
        # Nor does a client that does not trust the certificate.
        async with httpx.AsyncClient(timeout=5) as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(f"{base}/ready")


def test_a_private_file_is_replaced_whole_never_seen_empty(tmp_path: Path) -> None:
    """services.tlsfiles.write_private (the dev key, the bus's logins, TLS keys): a reader
    that opens the file while it is written finds the old contents, not an empty file (a
    key read the moment the file appears was once ''), and no scratch file stays behind."""
    from services.tlsfiles import write_private

    path = tmp_path / "dev-key"
    seen: list[str] = []

    class Watched(str):
        def encode(self, *args: object, **kw: object) -> bytes:  # type: ignore[override]
            seen.append(path.read_text())  # what a reader finds while it is written
            return str(self).encode()

    write_private(path, "old-key\n")
    write_private(path, Watched("new-key\n"))
    assert seen == ["old-key\n"]
    assert path.read_text() == "new-key\n" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["dev-key"]
