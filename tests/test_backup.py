"""``tokenbus backup`` and ``tokenbus restore`` (tokenbus/cli/backup.py): a backup taken as a
subprocess while a stack of real processes serves, restored onto a fresh nats-server, gives
a fresh stack there every key, budget and its spend, alias, file, batch and stored response;
bad backups and a non-empty bus are refused clearly; the store list misses no bucket or
stream named in the code; the backup CronJob renders and runs a command the CLI takes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import openai
import pytest
import yaml

from auth import budgets
from jobs.files import BUCKET as FILES_BUCKET
from services import aliases
from tests.support.busdata import key_store, new_model
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.repo import ROOT, run_cli
from tests.support.waits import wait_for
from tokenbus.cli import backup

ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]',
    # An answer token costs $0.001: a request's spend is known (max_tokens with ignore_eos).
    "TOKENBUS_ROUTER__PRICE": json.dumps({"input": 0, "output": 1000}),
}
PACKAGES = (
    "auth",
    "bus_schemas",
    "dialects",
    "engine_worker",
    "filter",
    "gateway",
    "jobs",
    "router",
    "services",
    "telemetry",
    "tokenbus",
)
# Module constants named like a store that are no store (environment variables).
NOT_STORES = {"TOKENBUS_VLLM_SCRIPTED_CORE", "TOKENBUS_TELEMETRY__NATS_MONITOR_URLS"}


# -- the store list -------------------------------------------------------------------------------
def _named_in_code() -> dict[str, str]:
    """Every module-level constant of the packages whose value is a bucket-like or stream-like
    name (``tokenbus_x`` or ``TOKENBUS_X``): value -> where."""
    found: dict[str, str] = {}
    pat = re.compile(
        r'^[A-Z][A-Z0-9_]* *(?:: *str *)?= *"(tokenbus_[a-z0-9_]+|TOKENBUS_[A-Z0-9_]+)"'
    )
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = pat.match(line)
                if m:
                    found.setdefault(m.group(1), f"{path.relative_to(ROOT)}:{n}")
    return found


@pytest.mark.unit
def test_the_store_list_names_every_bucket_and_stream_in_the_code() -> None:
    listed = {s.name for s in backup.STORES} | set(backup.SKIPPED)
    named = _named_in_code()
    missing = {v: where for v, where in named.items() if v not in listed | NOT_STORES}
    assert not missing, f"add these to tokenbus.cli.backup.STORES (or SKIPPED): {missing}"
    # And the list names nothing the code does not (a renamed bucket is renamed there too).
    assert listed <= set(named), sorted(listed - set(named))
    assert len({s.stream for s in backup.STORES}) == len(backup.STORES)
    assert FILES_BUCKET in listed and "tokenbus_ratelimit" in backup.SKIPPED


# -- bad input, offline ------------------------------------------------------------------------
@pytest.mark.stack
def test_restore_from_a_missing_or_corrupt_folder_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "TOKENBUS_NATS_URL": "nats://127.0.0.1:1"}  # never reached
    r = run_cli("restore", "--from", str(tmp_path / "nowhere"), env=env)
    assert r.returncode == 2 and "no backup at" in r.stderr, r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("restore", "--from", str(empty), env=env)
    assert r.returncode == 2 and "no manifest.json" in r.stderr, r.stderr
    (empty / "manifest.json").write_text("{not json")
    r = run_cli("restore", "--from", str(empty), env=env)
    assert r.returncode == 2 and "is not JSON" in r.stderr, r.stderr
    (empty / "manifest.json").write_text(json.dumps({"format": "other"}))
    r = run_cli("restore", "--from", str(empty), env=env)
    assert r.returncode == 2 and "not a tokenbus-backup manifest" in r.stderr, r.stderr


# -- the whole round trip ------------------------------------------------------------------------
async def _stream_counts(url: str) -> dict[str, int]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        return {str(i.config.name): int(i.state.messages) for i in await js.streams_info()}
    finally:
        await nc.drain()


async def _spent(url: str, rec: Any) -> tuple[int, int]:
    nc = await nats.connect(url)
    try:
        book = await budgets.SpendBook(nc).open()
        return await book.spent(budgets.Budget(f"k.{rec.id}", rec.budget_period, None, None))
    finally:
        await nc.drain()


async def _chat(stack: ProcStack, key: str, model: str) -> str:
    async with stack.openai(key) as oai:
        r = await oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "back me up"}],
            max_tokens=2,
            extra_body={"ignore_eos": True},
        )
    return str(r.choices[0].message.content)


async def _wait_batch(oai: openai.AsyncOpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (b := await oai.batches.retrieve(batch_id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch still {b.status}"
        await asyncio.sleep(0.2)
    return b


async def _stack(procs: Procs, model: str) -> ProcStack:
    procs.log_dir.mkdir(parents=True, exist_ok=True)
    return await start_stack(
        procs,
        model,
        "auth",
        "ratelimit",
        "ingress",
        "router",
        worker_args=("--sim-prefill-ms", "2", "--sim-decode-ms", "1"),
        env=ENV,
    )


@pytest.fixture
async def source(tmp_path: Path) -> AsyncIterator[NatsServer]:
    srv = NatsServer(tmp_path / "nats-a").start()
    yield srv
    srv.stop()


@pytest.fixture
async def target(tmp_path: Path) -> AsyncIterator[NatsServer]:
    srv = NatsServer(tmp_path / "nats-b").start()
    yield srv
    srv.stop()


@pytest.mark.stack
async def test_a_backup_taken_while_serving_restores_everything_on_a_fresh_server(
    source: NatsServer, target: NatsServer, tmp_path: Path
) -> None:
    model, alias = new_model(), f"alias-{new_model()}"
    async with key_store(source.url) as keys:
        key, rec = await keys.create("backed-up", budget_usd=1.0, budget_period="month")
        busy, _ = await keys.create("busy")
    nc = await nats.connect(source.url)
    try:
        await aliases.set_alias(nc, alias, model)
    finally:
        await nc.drain()
    out = tmp_path / "backup"
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"l{i}"}]},
        }
        for i in range(3)
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with Procs(source.url, tmp_path / "logs-a") as procs:
        stack = await _stack(procs, model)
        # Spend through the alias: 2 answer tokens at $0.001 each, twice.
        for _ in range(2):
            assert await _chat(stack, key, alias)
        deadline = time.monotonic() + 20
        while (spend := await _spent(source.url, rec)) != (4000, 0):
            assert time.monotonic() < deadline, spend
            await asyncio.sleep(0.05)
        async with stack.openai(key) as oai:
            f = await oai.files.create(file=("in.jsonl", content), purpose="batch")
            b = await oai.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            done = await _wait_batch(oai, b.id)
            assert done.status == "completed" and done.output_file_id
            output = (await oai.files.content(done.output_file_id)).read()
            resp = await oai.responses.create(model=model, input="keep me", max_output_tokens=8)
        # The batch and the response spent too: what the key has spent once all settled.
        deadline = time.monotonic() + 20
        while (spend := await _spent(source.url, rec))[1] != 0:
            assert time.monotonic() < deadline, spend
            await asyncio.sleep(0.05)
        spent = spend[0]
        assert spent > 4000
        # The backup, as a process, while another key keeps the stack busy.
        stop = asyncio.Event()
        served = 0

        async def traffic() -> None:
            nonlocal served
            while not stop.is_set():
                await _chat(stack, busy, model)
                served += 1

        load = asyncio.create_task(traffic())
        cli = {**os.environ, "TOKENBUS_NATS_URL": source.url}
        t0 = time.monotonic()
        r = await asyncio.to_thread(run_cli, "backup", "--out", str(out), env=cli, timeout=120)
        took = time.monotonic() - t0
        stop.set()
        await load
        assert r.returncode == 0, r.stdout + r.stderr
        assert served >= 1 and stack.all_alive()
        print(r.stdout, f"(backup process: {took:.2f}s)")
        on_source = await _stream_counts(source.url)

    # Every stream on the source is in the list, or skipped on purpose.
    # What is skipped: buckets (their streams KV_<name>) and streams by their own names.
    known = {s.stream for s in backup.STORES} | {f"KV_{n}" for n in backup.SKIPPED}
    known |= set(backup.SKIPPED)
    assert set(on_source) <= known, sorted(set(on_source) - known)
    manifest = json.loads((out / "manifest.json").read_text())
    saved = {e["stream"]: e for e in manifest["streams"] if not e.get("absent")}
    for name in ("KV_tokenbus_keys", "KV_tokenbus_spend", "KV_tokenbus_aliases"):
        assert saved[name]["messages"] >= 1, name
    assert saved["OBJ_tokenbus_files"]["bytes"] >= len(content) + len(output)
    assert "KV_tokenbus_ratelimit" not in saved
    assert not list(tmp_path.glob("*.partial"))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"backup folder: {size} bytes")

    # A fresh server: restore, then a fresh stack on it.
    cli = {**os.environ, "TOKENBUS_NATS_URL": target.url}
    r = await asyncio.to_thread(run_cli, "restore", "--from", str(out), env=cli, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    on_target = await _stream_counts(target.url)
    for name, e in saved.items():
        assert on_target[name] == e["messages"], (name, on_target[name], e["messages"])
    assert await _spent(target.url, rec) == (spent, 0)
    with Procs(target.url, tmp_path / "logs-b") as procs:
        stack = await _stack(procs, model)
        async with key_store(target.url) as keys:
            ids = {k.id for k in await keys.list()}
        assert rec.id in ids and len(ids) == 2
        shown = json.loads(run_cli("keys", "show", rec.id, "--json", env=cli, check=True).stdout)
        assert shown["spent_usd"] == pytest.approx(spent / 1e6), shown
        # The old key is served, through the restored alias, and spends on.
        assert await _chat(stack, key, alias)
        async with stack.openai(key) as oai:
            assert (await oai.files.content(f.id)).read() == content
            b2 = await oai.batches.retrieve(b.id)
            assert b2.status == "completed" and b2.output_file_id == done.output_file_id
            assert (await oai.files.content(done.output_file_id)).read() == output
            assert (await oai.responses.retrieve(resp.id)).id == resp.id
        listed = json.loads(run_cli("batches", "--json", env=cli, check=True).stdout)
        assert [x["id"] for x in listed] == [b.id]
        deadline = time.monotonic() + 20
        while (spend := await _spent(target.url, rec)) != (spent + 2000, 0):
            assert time.monotonic() < deadline, spend
            await asyncio.sleep(0.05)
        assert stack.all_alive()

    # The bus now holds messages: a second restore refuses, unless --force.
    r = await asyncio.to_thread(run_cli, "restore", "--from", str(out), env=cli, timeout=120)
    assert r.returncode == 1 and "--force" in r.stderr and "KV_tokenbus_keys" in r.stderr
    assert (await _stream_counts(target.url))["KV_tokenbus_keys"] == saved["KV_tokenbus_keys"][
        "messages"
    ]
    r = await asyncio.to_thread(
        run_cli, "restore", "--from", str(out), "--force", env=cli, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert await _spent(target.url, rec) == (spent, 0)  # the backup's, not what came after
    # A backup never writes over one: the folder exists.
    r = await asyncio.to_thread(run_cli, "backup", "--out", str(out), env=cli, timeout=60)
    assert r.returncode == 1 and "not an empty folder" in r.stderr, r.stderr


@pytest.mark.stack
def test_a_changed_messages_file_is_refused_before_the_bus_is_touched(tmp_path: Path) -> None:
    """A backup altered after it was written (here: made by hand) fails its checksum."""
    folder = tmp_path / "b"
    (folder / "KV_tokenbus_keys").mkdir(parents=True)
    (folder / "KV_tokenbus_keys" / "config.json").write_text("{}")
    (folder / "KV_tokenbus_keys" / "messages.jsonl").write_text('{"subject": "x"}\n')
    (folder / "manifest.json").write_text(
        json.dumps(
            {
                "format": backup.FORMAT,
                "version": backup.VERSION,
                "streams": [{"stream": "KV_tokenbus_keys", "messages": 1, "sha256": "0" * 64}],
            }
        )
    )
    env = {**os.environ, "TOKENBUS_NATS_URL": "nats://127.0.0.1:1"}
    r = run_cli("restore", "--from", str(folder), env=env)
    assert r.returncode == 2 and "checksum" in r.stderr, r.stderr
    (folder / "KV_tokenbus_keys" / "messages.jsonl").unlink()
    r = run_cli("restore", "--from", str(folder), env=env)
    assert r.returncode == 2 and "is missing" in r.stderr, r.stderr


# -- the CronJob ---------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_backup_cronjob_runs_tokenbus_backup_as_admin_onto_a_volume() -> None:
    from tokenbus.cli import build_parser

    path = ROOT / "deploy" / "k8s" / "components" / "backup" / "backup.yaml"
    docs = {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}
    cron, pvc = docs["CronJob"], docs["PersistentVolumeClaim"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    script = c["args"][-1]
    m = re.search(r"tokenbus (backup --out \S+)", script)
    assert m, script
    args = build_parser().parse_args(m.group(1).replace('"', "").split())
    assert args.cmd == "backup"
    assert pod["securityContext"]["runAsUser"] == 10009  # the admin role's uid
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    out_dir = args.out.split("/$")[0]
    assert volumes[mounts[out_dir]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TOKENBUS_NATS_LOGIN_FILE"] == "/etc/tokenbus/login/admin.json"


@pytest.mark.stack
def test_the_backup_component_renders_valid_objects_with_the_overlay(tmp_path: Path) -> None:
    """The cpu-sim overlay with components/backup, as its notes say, gives Kubernetes a
    valid CronJob and volume that read the admin login and the CA the base makes."""
    import shutil

    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    from tests import test_k8s as k

    if k.KUBECTL is None:
        pytest.skip("no kubectl to render the manifests")
    import kubernetes_validate

    root = tmp_path / "k8s"
    shutil.copytree(k.K8S, root, ignore=shutil.ignore_patterns("bus"))
    names = [arg for name in k.TLS_NAMES for arg in ("--tls-name", name)]
    r = run_cli(
        "deploy", "init", "--dir", str(root / "base" / "bus"), "--nodes", "3",
        "--nats-host", "nats", *names,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    docs = k._kustomize_with_component(root, "backup")
    cron = k._one(docs, "CronJob", "tokenbus-backup")
    k._one(docs, "PersistentVolumeClaim", "tokenbus-backup")
    for d in docs:
        if d["kind"] in ("CronJob", "PersistentVolumeClaim"):
            kubernetes_validate.validate(d, k.K8S_VERSION, strict=True)
            assert d["metadata"]["namespace"] == k.NAMESPACE
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tokenbus"
    assert k._secret_refs(pod["spec"]) == {"tokenbus-admin"}
    k._one(docs, "Secret", "tokenbus-admin")
    k._one(docs, "ConfigMap", "tokenbus-nats-ca")


# -- the file store's bound and its gauge ------------------------------------------------------
@pytest.mark.stack
async def test_the_file_store_is_bounded_and_telemetry_reports_how_full_it_is(
    tmp_path: Path,
) -> None:
    """files.max_bytes is the object store's own bound (uploads past it: 507), and the
    telemetry role probes the store on the locked bus: bytes against the bound, the gauges
    TokenbusFileStoreFilling reads."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from bus_schemas import errors as E
    from jobs.files import FileStore
    from services.config import FilesSettings, Settings
    from services.natsconf import role_login
    from telemetry.service import FILES_INFO, Telemetry
    from tests.lockedbus import LockedBus
    from tests.support.inprocess import settings

    assert Settings().files.max_bytes <= 4 << 30  # room left on a 10Gi NATS volume
    bus = LockedBus(tmp_path / "bus").start()
    try:
        admin = await bus.admin()
        limit = 2 << 20
        store = await FileStore(admin, FilesSettings(max_bytes=limit)).open()
        await store.put("", "a.jsonl", "batch", b"x" * (1800 << 10))
        with pytest.raises(E.StorageFull):
            await store.put("", "b.jsonl", "batch", b"y" * (1 << 20))
        login = role_login(bus.users, "telemetry")
        cfg = settings(bus.url, nats_user=login["user"], nats_password=login["password"],
                       telemetry={"db_path": str(tmp_path / "t.db"), "metrics_port": 0,
                                  "probe_interval_s": 0})  # fmt: skip
        async with Telemetry(cfg) as tel:
            await tel.probe()
            fs = tel.metrics.health.file_store
            assert fs is not None and fs[1] == limit and 0.8 < fs[0] / limit <= 1, fs
            text = generate_latest(tel.metrics.registry).decode()
            got = {
                s.name: s.value
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.name.startswith("tokenbus_file_store")
            }
            assert got == {
                "tokenbus_file_store_bytes": fs[0],
                "tokenbus_file_store_max_bytes": limit,
            }
        assert FILES_INFO.endswith(f"OBJ_{FILES_BUCKET}")
        await admin.drain()
    finally:
        bus.stop()


# -- a cluster -------------------------------------------------------------------------------------
@pytest.mark.stack
async def test_a_cluster_is_backed_up_through_any_node_and_restored_replicated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three locked nodes, every store R3: the backup through node 2 alone (the JetStream
    API answers cluster-wide, no store folder is read); restored through node 1 of a fresh
    cluster with --replicas 3, every stream is on all three nodes and reads back."""
    from auth.store import KeyStore
    from jobs.files import FileStore
    from services.config import FilesSettings
    from tests.lockedbus import LockedCluster

    monkeypatch.setenv("TOKENBUS_KV_REPLICAS", "3")
    one = LockedCluster(tmp_path / "one").start()
    two = LockedCluster(tmp_path / "two").start()
    try:
        await one.routed()
        await two.routed()
        nc = await one.admin(0)
        keys = await KeyStore(nc).open(watch=False)
        key, rec = await keys.create("clustered")
        await keys.close()
        book = await budgets.SpendBook(nc).open()
        await book.set_owner_budget("team", hard_usd=5.0, soft_usd=None, period="month")
        data = os.urandom(300_000)  # three chunks
        f = await (await FileStore(nc, FilesSettings()).open()).put("o", "f.jsonl", "batch", data)
        infos = {i.config.name: i for i in await nc.jetstream().streams_info()}
        assert {i.config.num_replicas for i in infos.values()} == {3}, infos.keys()
        await nc.drain()

        out = tmp_path / "backup"
        cli = {**os.environ, **one.env("admin"), "TOKENBUS_NATS_URL": one.url(2)}
        r = await asyncio.to_thread(run_cli, "backup", "--out", str(out), env=cli, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        cli = {**os.environ, **two.env("admin"), "TOKENBUS_NATS_URL": two.url(1)}
        r = await asyncio.to_thread(
            run_cli, "restore", "--from", str(out), "--replicas", "3", env=cli, timeout=120
        )
        assert r.returncode == 0, r.stdout + r.stderr

        nc = await two.admin(0)
        try:
            restored = {i.config.name: i for i in await nc.jetstream().streams_info()}
            assert set(restored) == set(infos)
            for name, info in restored.items():
                assert info.config.num_replicas == 3, name
                assert info.state.messages == infos[name].state.messages, name
            for i in range(3):  # each node's own replica holds every message
                await wait_for(
                    lambda i=i: (
                        two.stream_state(i, "OBJ_tokenbus_files").get("messages")
                        == infos["OBJ_tokenbus_files"].state.messages
                    ),
                    what=f"node {i} without the files",
                )
            keys = await KeyStore(nc).open(watch=False)
            await keys.catch_up(key)
            assert keys.lookup(key).id == rec.id
            await keys.close()
            team = await (await budgets.SpendBook(nc).open()).owner_budget("team")
            assert team is not None and team.hard == 5_000_000
            got = await (await FileStore(nc, FilesSettings()).open()).content(f["id"], "o")
            assert got == data
        finally:
            await nc.drain()
    finally:
        one.stop()
        two.stop()
