"""The locked bus: a generated nats-server config with a user per role and subject permissions."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus_schemas import codec, subjects
from services.natsconf import ROLES, generate, role_env, role_login
from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
from tokenbus import Client

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "hi"}]


class Locked:
    """A nats-server on a config from ``tokenbus nats-config``, written to ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.conf, self.users = generate(folder, port=self.port)
        self.proc = spawn_nats(self.port, "-c", str(self.conf))
        self.url = f"nats://127.0.0.1:{self.port}"

    def env(self, role: str) -> dict[str, str]:
        return role_env(self.users, role)

    async def connect(self, role: str, **kw: Any) -> nats.aio.client.Client:
        return await nats.connect(self.url, **role_login(self.users, role), **kw)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Locked]:
    lk = Locked(tmp_path / "locked")
    yield lk
    lk.proc.terminate()
    lk.proc.wait(10)


def test_secrets_file_is_private_and_passwords_are_kept(tmp_path: Path) -> None:
    conf, users = generate(tmp_path / "x")
    assert users.stat().st_mode & 0o777 == 0o600
    first = users.read_text()
    generate(tmp_path / "x")
    assert users.read_text() == first
    text = conf.read_text()
    assert all(f'user: "{r}"' in text for r in ROLES)


async def test_a_client_cannot_reach_workers_or_stages_directly(locked: Locked) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await locked.connect("client", error_cb=on_error)
    try:
        await nc.publish(subjects.engine_generate("m", "r"), b"x")
        await nc.publish(subjects.stage(subjects.STAGE_ROUTE), b"x")
        await nc.subscribe(subjects.engine_generate("m", "r"), cb=_noop)
        await nc.flush()
        await wait_for(
            lambda: sum("permissions violation" in e.lower() for e in errors) >= 3,
            what="three permissions violations",
        )
        assert sum("permissions violation" in e.lower() for e in errors) >= 3, errors
    finally:
        await nc.close()
    with pytest.raises(Exception):  # noqa: B017 - any refusal of a wrong password will do
        await nats.connect(
            locked.url,
            user="client",
            password="wrong",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
        )


async def _noop(msg: Any) -> None:
    return None


URL = "/v1/chat/completions"


async def test_every_service_works_on_the_locked_bus(locked: Locked, tmp_path: Path) -> None:
    model = "locked-model"
    with Procs(locked.url, tmp_path) as procs:
        # Each process logs in as its own role; the test cannot listen for heartbeats.
        stack = await start_stack(
            procs,
            model,
            "ingress",
            "router",
            env={"TOKENBUS_BRIDGE__FUSE_ROUTER": "false"},
            env_for=lambda role, _: locked.env(role),
            login=role_login(locked.users, "admin"),
        )
        async with stack.openai() as oai:
            out = await oai.chat.completions.create(model=model, messages=MSG, max_tokens=3)
            assert out.usage is not None and out.usage.completion_tokens == 3
            # The bridge's files (object store) and batches (work queue, KV) on the locked
            # bus: a batch runs through to its output file.
            line = {"model": model, "messages": MSG, "max_tokens": 2}
            body = "".join(
                json.dumps({"custom_id": f"l{i}", "method": "POST", "url": URL, "body": line})
                + "\n"
                for i in range(3)
            )
            f = await oai.files.create(file=("in.jsonl", body.encode()), purpose="batch")
            b = await oai.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
            for _ in range(300):
                b = await oai.batches.retrieve(b.id)
                if b.status in ("completed", "failed"):
                    break
                await asyncio.sleep(0.1)
            assert b.status == "completed" and b.output_file_id, b
            got = (await oai.files.content(b.output_file_id)).read().decode().splitlines()
            assert sorted(json.loads(x)["custom_id"] for x in got) == ["l0", "l1", "l2"]
        e = locked.env("client")
        async with await Client.connect(
            locked.url, user=e["TOKENBUS_NATS_USER"], password=e["TOKENBUS_NATS_PASSWORD"]
        ) as c:
            whole = await c.chat_completion(model, MSG, max_tokens=4)
            assert whole.usage.completion_tokens == 4
            # A background response through ingress (its record, work and events stream),
            # followed to its end.
            q = await c.background_response(model, "locked", max_output_tokens=3)
            evs = [ev async for ev in c.response_events(q["id"], poll_s=0.1, timeout=60)]
            assert evs[-1]["type"] in ("response.completed", "response.incomplete"), evs
            s = c.chat(model, MSG, max_tokens=10_000)
            await s.__anext__()
            await s.aclose()  # the cancel is allowed for clients
        nc = await locked.connect("worker")
        hb = await nc.subscribe(subjects.engine_generate(model, "x"))
        await nc.publish(subjects.heartbeat(model, "spy"), codec.encode({}))
        await hb.unsubscribe()
        await nc.close()
        for p in procs.procs:
            assert p.alive(), p.name
            # nats-server says "Permissions Violation", nats-py "permissions violation"
            # (a bridge once could not hear a background response's cancel). One is meant: a
            # worker tries to make the usage records' stream when none acknowledges its
            # records (telemetry/records.py), which its role may not; the try's inbox too.
            said = re.findall(
                r"permissions violation for \w+ to \\?\"([^\"\\]+)", p.output().lower()
            )
            meant = ("$js.api.stream.info.tokenbus_usage", "_inbox.")
            assert [x for x in said if not x.startswith(meant)] == [], (p.name, said)


# -- services joining a running stack -------------------------------------------------------
async def _heard_beating(lk: Locked, model: str, replica: str, timeout: float = 20) -> bool:
    """Whether ``replica`` of ``model`` is heard beating on the locked bus within ``timeout``
    seconds (listening as the admin)."""
    nc = await lk.connect("admin")
    seen: set[str] = set()

    async def cb(msg: Any) -> None:
        hb = codec.decode_map(msg.data)
        if hb.get("model") == model:
            seen.add(str(hb["replica"]))

    await nc.subscribe(subjects.heartbeat_wildcard(), cb=cb)
    try:
        await wait_for(lambda: replica in seen, timeout=timeout)
        return True
    except AssertionError:
        return False
    finally:
        await nc.drain()


async def test_a_worker_started_beside_a_stack_finds_its_credentials(tmp_path: Path) -> None:
    # `tokenbus up` keeps the locked bus's credentials in <data_dir>/nats-locked: a service
    # started by hand with the same data dir logs in as its own role without being told.
    lk = Locked(tmp_path / "data" / "nats-locked")
    try:
        with Procs(lk.url, tmp_path) as procs:
            w = procs.start(
                "worker",
                *("serve", "worker", "--model", "joined", "--replica", "joined-0"),
                env={"TOKENBUS_UP__DATA_DIR": str(tmp_path / "data")},
            )
            if not await _heard_beating(lk, "joined", "joined-0"):
                raise AssertionError(f"the worker did not join:\n{w.output()[-2000:]}")
            assert w.alive() and "Authorization Violation" not in w.output()
    finally:
        lk.proc.terminate()
        lk.proc.wait(10)


async def test_a_service_refused_by_the_server_exits_at_once_naming_the_fix(
    locked: Locked, tmp_path: Path
) -> None:
    with Procs(locked.url, tmp_path) as procs:
        bad = {"TOKENBUS_NATS_USER": "worker", "TOKENBUS_NATS_PASSWORD": "wrong"}
        w = procs.start("worker", "serve", "worker", "--model", "m", env=bad)
        code = await asyncio.to_thread(w.proc.wait, 15)
    assert code == 2
    out = w.output()
    assert "refused" in out and "TOKENBUS_NATS_PASSWORD" in out and "nats-users.json" in out
    assert out.count("Authorization Violation") <= 1  # said once, not retried forever


async def test_sigterm_ends_a_service_still_waiting_for_nats(tmp_path: Path) -> None:
    nowhere = f"nats://127.0.0.1:{free_port()}"
    with Procs(nowhere, tmp_path) as procs:
        p = procs.start("ingress", "serve", "ingress")
        # Until it has tried NATS and is trying again (each refused attempt is logged).
        await wait_for(
            lambda: p.output().count('"nats_error"') >= 2 or not p.alive(),
            timeout=30,
            what="the service never tried to reach NATS",
        )
        assert p.alive()
        p.signal(signal.SIGTERM)
        code = await asyncio.to_thread(p.proc.wait, 10)
    assert code == 0
