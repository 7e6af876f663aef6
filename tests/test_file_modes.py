"""What tokenbus writes to disk and who may read it (issue 32): no file that another local user
can read holds a password, and the nats-server configs hold none at all, only bcrypt hashes.

Checked on what ``tokenbus up`` and ``tokenbus deploy init`` really write: every file is
searched for every secret of the bus (each role's password, the callout's and the system
user's, the callout issuer's seed, the API keys ``tokenbus up`` makes), and the files that
hold one must be the expected ones, mode 0600, in folders others cannot read. Logging in is
checked on real nats-servers: every user with its password, none with the hash the config
holds, and (as root) each deployment uid reading only its own files."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import bcrypt
import nats
import pytest

from services import deploybundle
from services.deploybundle import NATS_UID, ROLE_UID
from services.natsconf import CALLOUT_FILE, HASH_COST, ROLES, generate
from tests.support.natsserver import spawn_nats
from tests.support.pids import stop_process
from tests.support.ports import free_port
from tests.support.repo import ROOT, run_cli
from tests.support.waits import wait_http
from tokenbus.launcher import nats_server_binary

pytestmark = pytest.mark.stack

# A user of the config and its password: `{user: "bridge", password: "$2b$04$...", ...`.
USER_PASSWORD = re.compile(r'user: "([^"]+)", password: "([^"]*)"')
BCRYPT = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _bus_secrets(folder: Path) -> dict[str, str]:
    """Every secret of a generated bus folder, by what it is."""
    users = json.loads((folder / "nats-users.json").read_text())
    out = {f"{r}'s password": p for r, p in users.items()}
    callout = json.loads((folder / CALLOUT_FILE).read_text())
    for k in ("password", "sys_password", "issuer_seed"):
        out[f"callout {k}"] = callout[k]
    return out


def _holders(root: Path, secrets: dict[str, str]) -> dict[str, set[str]]:
    """Each file under ``root`` that holds one of ``secrets`` (by its path relative to
    ``root``), and which."""
    found: dict[str, set[str]] = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            held = {name for name, value in secrets.items() if value.encode() in data}
            if held:
                found[str(path.relative_to(root))] = held
    return found


def _server_users(conf_text: str) -> dict[str, str]:
    """The users a server config names, each with what it holds for the password (which
    must be a bcrypt hash)."""
    users = dict(USER_PASSWORD.findall(conf_text))
    for user, stored in users.items():
        assert BCRYPT.match(stored), (user, "not a bcrypt hash")
    return users


def test_tokenbus_up_leaves_no_password_where_another_user_can_read_it(tmp_path: Path) -> None:
    """A data folder from before (the config world-readable, with every password in it, in a
    0755 folder) comes out of ``tokenbus up`` fixed, with the same passwords; the stack logs
    in with them against a config that holds their hashes only."""
    data = tmp_path / "data"
    folder = data / "nats-locked"
    generate(folder, callout=True)
    secrets = _bus_secrets(folder)
    (folder / "nats.conf").write_text("# an older tokenbus up\n" + "\n".join(secrets.values()))
    os.chmod(folder / "nats.conf", 0o644)
    os.chmod(folder, 0o755)
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    argv = [sys.executable, "-m", "tokenbus.cli", "up", "--port", str(port)]
    argv += ["--nats-port", str(nats_port), "--workers", "1", "--data-dir", str(data)]
    with open(tmp_path / "up.out", "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        )
    try:
        # Ready: every service logged in, after the keys were made logging in as admin.
        asyncio.run(wait_http(f"http://127.0.0.1:{port}/ready", 90))
        assert _bus_secrets(folder) == secrets  # the passwords are kept
        assert _mode(folder) == 0o700
        for name in ("nats.conf", "nats-users.json", CALLOUT_FILE):
            assert _mode(folder / name) == 0o600, name
        users = _server_users((folder / "nats.conf").read_text())
        assert set(users) == {*ROLES, "callout", "sys"} - {"client"}
        api_keys = {k: (data / k).read_text().strip() for k in ("dev-key", "admin-key")}
        held = _holders(data, secrets | api_keys)
        assert held == {
            "nats-locked/nats-users.json": {f"{r}'s password" for r in ROLES if r != "client"},
            "nats-locked/callout.json": {
                "callout password",
                "callout sys_password",
                "callout issuer_seed",
            },
            "dev-key": {"dev-key"},
            "admin-key": {"admin-key"},
        }
        for name in held:
            assert _mode(data / name) == 0o600, name
        # nats-server itself warns when its config holds a plain password.
        log = (data / "logs" / "nats-server.log").read_text()
        assert "Plaintext passwords" not in log
    finally:
        stop_process(proc, 60)


def test_the_logins_file_lists_only_the_users_the_config_has(tmp_path: Path) -> None:
    """With the callout there is no shared ``client`` user: a logins file from before that
    still lists one loses it (a stale password that logs in nowhere would mislead); without
    the callout it is there, and every other password is kept."""
    folder = tmp_path / "bus"
    generate(folder)
    before = json.loads((folder / "nats-users.json").read_text())
    assert "client" in before and "client" in _server_users((folder / "nats.conf").read_text())
    generate(folder, callout=True)
    after = json.loads((folder / "nats-users.json").read_text())
    assert set(after) == set(ROLES) - {"client"}
    assert after == {r: p for r, p in before.items() if r != "client"}
    assert "client" not in _server_users((folder / "nats.conf").read_text())


async def test_every_user_logs_in_with_its_password_and_none_with_the_hash(tmp_path: Path) -> None:
    """Every user of the config with the callout (the roles, the callout responder, the
    system user) logs in with its password; the hash the config holds is no password."""
    port = free_port()
    conf, users_file = generate(tmp_path / "bus", port=port, callout=True)
    hashes = _server_users(conf.read_text())
    assert all(h.startswith(f"$2b${HASH_COST:02d}$") for h in hashes.values())
    logins = {r: p for r, p in json.loads(users_file.read_text()).items() if r != "client"}
    callout = json.loads((tmp_path / "bus" / CALLOUT_FILE).read_text())
    logins |= {callout["user"]: callout["password"], callout["sys_user"]: callout["sys_password"]}
    assert set(hashes) == set(logins)
    url = f"nats://127.0.0.1:{port}"
    proc = spawn_nats(port, "-c", str(conf))
    try:
        for user, password in logins.items():
            nc = await nats.connect(url, user=user, password=password, allow_reconnect=False)
            await nc.close()
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(
                    url,
                    user=user,
                    password=hashes[user],
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    connect_timeout=2,
                )
    finally:
        proc.terminate()
        proc.wait(10)


def _deploy_folder_mode() -> int:
    return 0o711 if os.geteuid() == 0 else 0o700


def test_deploy_init_gives_the_servers_hashes_and_each_secret_to_its_owner_only(
    tmp_path: Path,
) -> None:
    """A 3-node bundle, as compose and Kubernetes get it: no role's, callout's or system
    user's password in ``auth.conf`` or a node's config, only hashes of the logins' passwords;
    every file but the certificates and ``tls.json`` mode 0600, every folder closed to others
    (also one an older version left open), and as root each file owned by its reader."""
    out = tmp_path / "bus"
    assert run_cli("deploy", "init", "--dir", str(out), "--nodes", "3").returncode == 0
    # A bundle from before, its folders open to all: the next run closes them.
    for d in (out, out / "roles", out / "tls"):
        os.chmod(d, 0o755)
    r = run_cli("deploy", "init", "--dir", str(out), "--nodes", "3")
    assert r.returncode == 0, r.stderr
    secrets = _bus_secrets(out)
    route = secrets.pop("route's password")
    confs = ["auth.conf", "nats-0.conf", "nats-1.conf", "nats-2.conf"]
    for name in confs:
        text = (out / name).read_text()
        for what, value in secrets.items():
            assert value not in text, (name, what)
    # The users' passwords, hashed: each role's hash is of the password in its login file.
    users = _server_users((out / "auth.conf").read_text())
    for role in ROLE_UID:
        login = json.loads((out / "roles" / f"{role}.json").read_text())
        assert bcrypt.checkpw(login["password"].encode(), users[role].encode()), role
    keys = {p.name: p.read_text() for p in (out / "tls").glob("*-key.pem")}
    held = _holders(out, secrets | keys | {"route password": route})
    # The one password in a server config: the route's, which the nodes dial each other with.
    assert {n: w for n, w in held.items() if n in confs} == {
        f"nats-{i}.conf": {"route password"} for i in range(3)
    }
    for name in held:
        assert _mode(out / name) == 0o600, name
    public = {"tls.json", "tls/ca.pem", "tls/server.pem", "tls/client.pem"}
    for path in out.rglob("*"):
        name = str(path.relative_to(out))
        if path.is_dir():
            assert _mode(path) == _deploy_folder_mode(), name
        elif name not in public:
            assert _mode(path) == 0o600, name
    if os.geteuid() == 0:  # the owners the compose file's containers read them as
        owners = dict.fromkeys(confs, NATS_UID) | {
            f"roles/{role}.json": uid for role, uid in ROLE_UID.items()
        }
        owners |= {CALLOUT_FILE: ROLE_UID["auth"], "nats-users.json": 0}
        owners["tls/server-key.pem"] = NATS_UID
        for name, uid in owners.items():
            assert (out / name).stat().st_uid == uid, name


def test_deploy_init_by_an_operator_keeps_the_folders_to_the_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not as root (an operator filling deploy/k8s/base/bus): no uid but the operator's
    reads anything there, so no folder is open to others."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    deploybundle.init(tmp_path / "bus")
    for d in ("", "roles", "tls"):
        assert _mode(tmp_path / "bus" / d) == 0o700, d


@pytest.mark.skipif(os.geteuid() != 0, reason="reads files as other uids: needs root")
def test_in_a_deployment_each_uid_reads_its_own_files_only() -> None:
    """As the compose file runs it (written as root, read by each service's uid): a role
    reads its own login and the CA, not another role's login, the users file or the server's
    config, and lists no folder; the nats-server's uid reads its configs and key."""
    top = Path(tempfile.mkdtemp(prefix="tokenbus-modes-"))
    try:
        os.chmod(top, 0o755)
        bus = top / "bus"
        deploybundle.init(bus, store_dir=str(top / "js"))

        def reads(uid: int, *cmd: str) -> bool:
            r = subprocess.run(
                list(cmd), user=uid, group=uid, extra_groups=[], capture_output=True, timeout=30
            )
            return r.returncode == 0

        for role, uid in ROLE_UID.items():
            other = "worker" if role != "worker" else "bridge"
            assert reads(uid, "cat", str(bus / "roles" / f"{role}.json")), role
            assert reads(uid, "cat", str(bus / "tls" / "ca.pem")), role
            for secret in (f"roles/{other}.json", "nats-users.json", "auth.conf", "nats.conf"):
                assert not reads(uid, "cat", str(bus / secret)), (role, secret)
            assert reads(uid, "cat", str(bus / CALLOUT_FILE)) == (role == "auth"), role
            assert not reads(uid, "ls", str(bus)), role
        server = [str(nats_server_binary()), "-t", "-c", str(bus / "nats.conf")]
        assert reads(NATS_UID, *server)
        assert not reads(ROLE_UID["admin"], *server)
    finally:
        shutil.rmtree(top)
