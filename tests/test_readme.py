"""The README followed as a new user follows it: `tokenbus up` (what `make up` runs) in a
fresh folder, then the README's own examples and commands, read from README.md and run as
printed from that folder (``.venv/bin/...``, ``.tokenbus/dev-key``).

Only the ports differ: the stack listens on free ports, not 8000 and 4222 (another stack may
hold those), so ``127.0.0.1:8000`` and ``127.0.0.1:4222`` in the README's text become this
stack's, and the CLI commands get ``TOKENBUS_NATS_URL`` for the same reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.pids import stop_process
from tests.support.ports import free_port
from tests.support.repo import ROOT

pytestmark = pytest.mark.stack

README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    """The README's fenced code blocks in ``lang``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.M | re.S)


def commands(prefix: str) -> list[str]:
    """Every line of the README's bash blocks that starts with ``prefix``, without its
    trailing comment."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            if line.startswith(prefix):
                out.append(line.split("  #")[0].strip())
    return out


@dataclass
class Up:
    """A running `tokenbus up` in ``folder`` and how to run the README's text there."""

    folder: Path
    port: int
    nats_port: int
    banner: list[str]

    def text(self, s: str) -> str:
        return s.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}").replace(
            "127.0.0.1:4222", f"127.0.0.1:{self.nats_port}"
        )

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
        return {**env, "TOKENBUS_NATS_URL": f"nats://127.0.0.1:{self.nats_port}", **extra}

    def sh(self, cmd: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", self.text(cmd)],
            cwd=self.folder,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [".venv/bin/python", "-c", self.text(code)],
            cwd=self.folder,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("readme")
    # The checkout's .venv, as `make up` made it (the one running these tests).
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    proc = subprocess.Popen(
        [".venv/bin/tokenbus", "up", "--port", str(port), "--nats-port", str(nats_port)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    banner: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            banner.append(line)
            if "Ctrl-C stops everything" in line:
                break
        else:
            raise AssertionError(f"tokenbus up did not come up: {banner}")
        yield Up(folder, port, nats_port, banner)
    finally:
        stop_process(proc, 60)


def test_the_banner_is_plain_lines_with_no_log_line_inside(up: Up) -> None:
    text = "".join(up.banner)
    assert "tokenbus is up" in text
    assert "\x1b[" not in text, text  # no coloured log line in the middle of it
    assert not re.search(r"\[\s*(info|debug|warning)\s*\]", text), text


def test_the_python_examples_run_as_printed(up: Up) -> None:
    examples = [b for b in blocks("python") if "127.0.0.1:" in b]
    assert len(examples) == 2, "the README's OpenAI SDK and NATS client examples"
    for code in examples:
        r = up.python(code)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip(), code
    # The NATS example ends with the whole answer's finish reason, usage and replica.
    assert re.search(r"\b(stop|length)\b.*\bsim-\d", r.stdout), r.stdout


def test_the_curl_example_streams(up: Up) -> None:
    (curl,) = [b for b in blocks("bash") if b.startswith("curl ")]
    r = up.sh(curl.replace("\\\n", " "))
    assert r.returncode == 0, r.stderr
    assert '"delta"' in r.stdout and "data: [DONE]" in r.stdout, r.stdout


def test_the_status_and_audit_commands_run(up: Up) -> None:
    for cmd in commands(".venv/bin/tokenbus status") + commands(".venv/bin/tokenbus audit"):
        r = up.sh(cmd)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    st = up.sh(".venv/bin/tokenbus status --json")
    assert len(json.loads(st.stdout)["replicas"]) == 2
    # A login the server refuses is said to be that, not an unreachable server.
    bad = up.sh(
        ".venv/bin/tokenbus status", TOKENBUS_NATS_USER="admin", TOKENBUS_NATS_PASSWORD="nope"
    )
    assert bad.returncode == 1
    assert "refused the login as 'admin'" in bad.stderr and "cannot reach" not in bad.stderr
    gone = up.sh(f".venv/bin/tokenbus --nats-url nats://127.0.0.1:{free_port()} status")
    assert gone.returncode == 1 and "cannot reach NATS" in gone.stderr


def test_the_bench_commands_against_the_stack_use_the_dev_key(up: Up) -> None:
    cmds = [c for c in commands(".venv/bin/tokenbus bench") if "--spawn" not in c]
    assert len(cmds) == 2, cmds  # --url and --mode nats
    for cmd in cmds:
        r = up.sh(cmd, timeout=300)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
        assert "using the dev key in .tokenbus/dev-key" in r.stderr
        assert "requests failed" not in r.stdout
    # Failures say why under the table, not only in the JSON.
    r = up.sh(
        ".venv/bin/tokenbus bench --url http://127.0.0.1:8000/v1 --api-key tb-wrong "
        "--concurrency 1 --requests-per-client 1"
    )
    assert r.returncode == 1
    assert "1 of 1 requests failed; the first: http_401" in r.stdout, r.stdout
    assert "using the dev key" not in r.stderr


def test_keys_show_prints_times_and_router_show_prints_json(up: Up) -> None:
    made = up.sh(".venv/bin/tokenbus keys create --name readme --expires-in 1d --json")
    assert made.returncode == 0, made.stderr
    key_id = json.loads(made.stdout.splitlines()[0])["id"]
    shown = up.sh(f".venv/bin/tokenbus keys show {key_id}")
    assert re.search(r"created_at: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", shown.stdout), shown
    assert re.search(r"expires_at: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", shown.stdout), shown
    assert up.sh(".venv/bin/tokenbus router set tokenbus-sim --policy round_robin").returncode == 0
    rows = up.sh(".venv/bin/tokenbus router show").stdout.splitlines()
    parsed = {name: json.loads(rest) for name, _, rest in (r.partition(": ") for r in rows)}
    assert parsed["tokenbus-sim"]["policy"] == "round_robin", rows
    assert up.sh(".venv/bin/tokenbus router reset tokenbus-sim").returncode == 0
