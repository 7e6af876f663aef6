"""What JetStream acknowledges is on disk first: every nats-server configuration tokenbus
writes (``make up``'s open and locked servers, ``tokenbus nats-config``, the compose and
bundle nodes of ``tokenbus deploy init``, the bench's server, the Kubernetes chart's values)
sets ``sync_interval: always`` (services.config.NATS_SYNC), and a server started on one says
so on its monitoring port. ``nats_sync`` (TOKENBUS_NATS_SYNC) trades it for an interval."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pydantic
import pytest
import yaml

from services import deploybundle, natsconf
from services.config import NATS_SYNC, Settings
from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port
from tests.support.repo import ROOT
from tokenbus.launcher import _nats_server_args, nats_server_binary

pytestmark = pytest.mark.stack

SYNC_LINE = re.compile(r"jetstream \{[^}]*sync_interval: \"([^\"]+)\"[^}]*\}")


def _sync_of(conf: Path) -> str:
    (found,) = SYNC_LINE.findall(conf.read_text())
    return str(found)


def test_the_policy_is_every_write() -> None:
    assert NATS_SYNC == "always" and Settings().nats_sync == "always"


def test_every_config_tokenbus_writes_syncs_before_it_acknowledges(tmp_path: Path) -> None:
    conf, _ = natsconf.generate(tmp_path / "locked", callout=True)
    assert _sync_of(conf) == "always"
    written = deploybundle.init(tmp_path / "bundle", nodes=3, tls=False)
    nodes = [p for p in written if p.name.startswith("nats") and p.suffix == ".conf"]
    assert len(nodes) == 3 and {_sync_of(p) for p in nodes} == {"always"}
    for locked in (False, True):
        s = Settings()
        s.up.locked = locked
        args, _ = _nats_server_args(s, tmp_path / f"up-{locked}", free_port())
        assert _sync_of(Path(args[args.index("-c") + 1])) == "always"
        assert "-js" not in args  # JetStream, its store and its policy from the config
    values = yaml.safe_load((ROOT / "deploy" / "k8s" / "nats-values.yaml").read_text())
    assert values["config"]["jetstream"]["merge"]["sync_interval"] == NATS_SYNC


def test_a_server_on_the_generated_config_syncs_every_write(tmp_path: Path) -> None:
    port, http = free_port(), free_port()
    s = Settings()
    args, _ = _nats_server_args(s, tmp_path, port)
    conf = Path(args[args.index("-c") + 1])
    conf.write_text(conf.read_text() + f'http: "127.0.0.1:{http}"\n')
    proc = spawn_nats(port, *args)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/varz", timeout=10) as r:
            js = json.load(r)["jetstream"]["config"]
        assert js["sync_always"] is True
        assert js["store_dir"].startswith(str(tmp_path))
    finally:
        proc.kill()
        proc.wait()


def test_an_interval_is_the_operators_choice_and_nonsense_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENBUS_NATS_SYNC", "1s")
    s = Settings()
    assert s.nats_sync == "1s"
    args, _ = _nats_server_args(s, tmp_path, free_port())
    conf = Path(args[args.index("-c") + 1])
    assert _sync_of(conf) == "1s"
    r = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for bad in ("never", "0s", "1 s", "always; listen: 0.0.0.0:1"):
        monkeypatch.setenv("TOKENBUS_NATS_SYNC", bad)
        with pytest.raises(pydantic.ValidationError, match="nats_sync"):
            Settings()
        with pytest.raises(ValueError, match="neither 'always' nor a duration"):
            natsconf.jetstream_block("/tmp/x", bad)
