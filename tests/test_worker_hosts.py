"""A login per GPU host (issue 64): each host's workers log in as ``worker-<host>``, which
may hear, beat, claim and publish KV events only as the replica ids the deployment gave that
host. A real nats-server on the generated config, real worker processes."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import nats
import pytest

from bus_schemas import subjects
from services import deploybundle
from services.natsconf import generate, parse_worker_hosts, role_env, role_login
from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.waits import live_replicas, wait_for
from tokenbus import Client

pytestmark = pytest.mark.stack

MODEL = "hosted"
MSG = [{"role": "user", "content": "which host?"}]
HOSTS = {"gpu-a": [f"{MODEL}-a0"], "gpu-b": [f"{MODEL}-b0"]}


def test_worker_host_options_are_parsed_and_bad_ones_refused() -> None:
    assert parse_worker_hosts(["a=r1,r2", "b=r3", "a=r4"]) == {"a": ["r1", "r2", "r4"], "b": ["r3"]}
    for bad, why in (
        (["a"], "HOST=REPLICA"),
        (["a="], "HOST=REPLICA"),
        (["a=r1", "b=r1"], "both"),
        (["a b=r1"], "host name"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_worker_hosts(bad)


def test_deploy_init_writes_a_login_per_host_and_drops_a_host_taken_out(tmp_path: Path) -> None:
    deploybundle.init(tmp_path, tls=False, worker_hosts=HOSTS)
    roles = tmp_path / deploybundle.ROLES_DIR
    a = json.loads((roles / "worker-gpu-a.json").read_text())
    assert a["user"] == "worker-gpu-a" and a["password"]
    auth = (tmp_path / deploybundle.AUTH_CONF).read_text()
    assert a["password"] not in auth  # its hash only
    assert f"tb.v1.engine.*.{MODEL}-a0.>" in auth
    # Run again without the list: the hosts and their passwords are kept.
    deploybundle.init(tmp_path, tls=False)
    assert json.loads((roles / "worker-gpu-a.json").read_text()) == a
    # A list without gpu-a: its login is gone, gpu-b's kept.
    b = json.loads((roles / "worker-gpu-b.json").read_text())
    deploybundle.init(tmp_path, tls=False, worker_hosts={"gpu-b": HOSTS["gpu-b"]})
    assert not (roles / "worker-gpu-a.json").exists()
    assert json.loads((roles / "worker-gpu-b.json").read_text()) == b
    auth = (tmp_path / deploybundle.AUTH_CONF).read_text()
    # No user of that name; still named for the callout to pass by (a changed auth_users
    # list is a reload nats-server refuses): a login with it is refused.
    assert '{user: "worker-gpu-a"' not in auth and '"worker-gpu-a"' in auth


async def _violations(url: str, login: dict[str, Any], actions: Any) -> list[str]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(url, error_cb=on_error, **login)
    try:
        n = await actions(nc)
        await nc.flush()
        await wait_for(
            lambda: sum("permissions violation" in e for e in errors) >= n,
            what=f"{n} operations refused",
        )
    finally:
        await nc.close()
    return errors


async def test_a_host_reaches_only_its_own_replicas_and_is_revoked_alone(tmp_path: Path) -> None:
    folder = tmp_path / "bus"
    port = free_port()
    conf, users = generate(folder, port=port, callout=True, worker_hosts=HOSTS)
    server = spawn_nats(port, "-c", str(conf))
    url = f"nats://127.0.0.1:{port}"
    admin = role_login(users, "admin")
    try:
        with Procs(url, tmp_path) as procs:
            await start_stack(
                procs,
                MODEL,
                "ingress",
                "auth",
                "router",
                workers=0,
                bridge=False,
                heartbeats=False,
                env_for=lambda role, _: role_env(users, role),
                login=admin,
            )
            for host, (replica,) in HOSTS.items():
                procs.start(
                    f"worker-{host}",
                    *("serve", "worker", "--model", MODEL, "--replica", replica),
                    env=role_env(users, f"worker-{host}"),
                )

            async def both() -> bool:
                return len(await live_replicas(url, MODEL, 0.5, **admin)) == 2

            await wait_for(both, timeout=60, what="both hosts' replicas beating")
            # Each names its host in its heartbeats: the one its bus login is for.
            heard: dict[str, Any] = {}

            async def both_heard() -> bool:  # an idle replica beats every 2 s
                heard.update(await live_replicas(url, MODEL, 0.5, **admin))
                return len(heard) == 2

            await wait_for(both_heard, timeout=30, what="a heartbeat of each host's replica")
            hosts = {r: hb.get("host") for r, hb in heard.items()}
            assert hosts == {rep: host for host, (rep,) in HOSTS.items()}, hosts
            async with await Client.connect(url, **admin) as tb:
                out = await tb.chat_completion(MODEL, MSG, max_tokens=3)
                assert out.usage is not None and out.usage.completion_tokens == 3

            # Host A's login, trying to be host B: hear B's requests (every tenant's prompts
            # sent there), beat, claim or publish KV events as B. Each refused by the server.
            b = HOSTS["gpu-b"][0]

            async def as_b(nc: Any) -> int:
                await nc.subscribe(subjects.engine_generate(MODEL, b))
                await nc.subscribe(subjects.worker_cancel(b))
                await nc.publish(subjects.heartbeat(MODEL, b), b"{}")
                await nc.publish(subjects.replica_claim(b), b"{}")
                await nc.publish(subjects.kv_events(MODEL, b), b"{}")
                # The large bodies the bridge sends B's replica when it asks (claim by pull).
                await nc.subscribe(f"{subjects.engine_body(b, '0' * 32)}.*")
                return 6

            login_a = role_login(users, "worker-gpu-a")
            await _violations(url, login_a, as_b)

            # Its own replica's subjects it may use.
            nc = await nats.connect(url, **login_a)
            await nc.subscribe(subjects.engine_generate(MODEL, HOSTS["gpu-a"][0]))
            await nc.subscribe(f"{subjects.engine_body(HOSTS['gpu-a'][0], '0' * 32)}.*")
            await nc.publish(subjects.kv_events(MODEL, HOSTS["gpu-a"][0]), b"{}")
            await nc.flush()
            assert nc.is_connected
            await nc.close()

            # Revoking host A (the list without it, the server told to reload): its worker is
            # cut off and stays out; host B goes on serving.
            generate(folder, port=port, callout=True, worker_hosts={"gpu-b": HOSTS["gpu-b"]})
            server.send_signal(signal.SIGHUP)

            async def a_refused() -> bool:
                # Until the server has reloaded (a look that raced the reload may still have
                # been let in, or closed by it): host A's login is refused.
                try:
                    probe = await nats.connect(url, allow_reconnect=False, **login_a)
                except Exception as exc:
                    return "uthorization" in str(exc)
                await probe.close()
                return False

            await wait_for(a_refused, timeout=60, what="host A's login refused after the reload")

            async def only_b() -> bool:
                live = await live_replicas(url, MODEL, 0.5, **admin)
                return set(live) == {b}

            await wait_for(only_b, timeout=60, what="host A's replica gone, B's left")
            async with await Client.connect(url, **admin) as tb:
                for _ in range(3):
                    out = await tb.chat_completion(MODEL, MSG, max_tokens=2)
                    assert out.replica == b
    finally:
        server.terminate()
        server.wait(10)
