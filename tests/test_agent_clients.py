"""Coding agents against a `tokenbus up` stack, configured as docs/clients/*.md tell a user
and run as those pages print it: Codex CLI (`codex exec`, the Responses API), Claude Code
(`claude -p`, the Messages API) and opencode (`opencode run`, chat completions), installed
from npm into a cache folder (skipped, with the reason, where node, npm or the registry is
missing).

The stack's one worker is the ``openai`` backend in front of a scripted chat upstream
(tests/fakes/scripted_upstream.py): the model asks for one shell command, then answers
quoting the tool output it is sent. So a pass means the CLI ran the command, its real output
went back through tokenbus, and the final answer quotes it. The pages' text is run with this
stack's ports and a fresh ``HOME`` (nothing of this machine's user configuration).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dialects.anthropic import to_messages
from tests.support.pids import stop_process
from tests.support.ports import free_port, wait_port
from tests.support.repo import ROOT
from tests.support.waits import wait_until
from tests.test_readme import Up

pytestmark = pytest.mark.stack

# Versions tried; Claude Code 2.1.197 is the last release that runs on Node 18/20.
PACKAGES = {
    "@openai/codex": "0.169.0",
    "@anthropic-ai/claude-code": "2.1.197",
    "opencode-ai": "1.18.33",
}
NPM_CACHE = Path.home() / ".cache" / "tokenbus-test-npm"
OUTPUT = "tokenbus-42"  # what `echo tokenbus-$((6*7))` prints: only running it makes it
# The user's own settings for these clients stay out of the run.
FOREIGN_ENV = ("TOKENBUS_", "CODEX_", "ANTHROPIC_", "CLAUDE_", "OPENAI_")


def page_blocks(page: str, lang: str) -> list[str]:
    text = (ROOT / "docs" / "clients" / page).read_text()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def page_block(page: str, lang: str, needle: str = "") -> str:
    return next(b for b in page_blocks(page, lang) if needle in b)


@pytest.fixture(scope="module")
def npm_bin() -> Path:
    """The folder with ``codex``, ``claude`` and ``opencode``, installed from npm once into
    a cache."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node or npm is not installed")

    def installed() -> bool:
        for name, version in PACKAGES.items():
            meta = NPM_CACHE / "node_modules" / name / "package.json"
            if not meta.exists() or json.loads(meta.read_text()).get("version") != version:
                return False
        return True

    if not installed():
        NPM_CACHE.mkdir(parents=True, exist_ok=True)
        specs = [f"{n}@{v}" for n, v in PACKAGES.items()]
        cmd = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(NPM_CACHE), *specs]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("npm install took over 5 minutes")
        if r.returncode != 0 or not installed():
            pytest.skip(f"npm install {' '.join(specs)} failed: {r.stderr[-800:]}")
    return NPM_CACHE / "node_modules" / ".bin"


class Scripted:
    """tests/fakes/scripted_upstream.py as a process on a free port."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        args = [sys.executable, "-m", "tests.fakes.scripted_upstream", "--port", str(self.port)]
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_port(self.port, 20)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def requests(self) -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = httpx.get(f"{self.url}/requests").json()
        return body

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scripted]:
    up = Scripted(tmp_path_factory.mktemp("scripted") / "upstream.log")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, upstream: Scripted) -> Iterator[Up]:
    """`tokenbus up` (what `make up` runs) in a fresh folder, its worker the openai backend
    in front of the scripted upstream, serving it as tokenbus-sim as the pages name it."""
    folder = tmp_path_factory.mktemp("stack")
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    worker = ["--workers", "1", "--backend", "openai", "--upstream-url", upstream.url]
    worker += ["--model", "tokenbus-sim", "--upstream-model", "scripted-model"]
    log = open(folder / "up.log", "wb")  # noqa: SIM115 - closed below
    args = ["up", "--port", str(port), "--nats-port", str(nats_port), *worker]
    proc = subprocess.Popen(
        [".venv/bin/tokenbus", *args], cwd=folder, env=env, stdout=log, stderr=log
    )
    try:
        # Up once the bridge is ready (the worker's replica is live) and the dev key written.
        deadline = time.monotonic() + 90
        while not (folder / ".tokenbus" / "dev-key").exists() or not ready(port):
            assert proc.poll() is None and time.monotonic() < deadline, log.name
            time.sleep(0.2)
        yield Up(folder, port, nats_port, [])
    finally:
        stop_process(proc, 60)
        log.close()


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def bridge_requests(up: Up) -> list[dict[str, Any]]:
    """The bridge's request log lines (``.tokenbus/logs/bridge-*.log``)."""
    out = []
    for log in sorted((up.folder / ".tokenbus" / "logs").glob("bridge-*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("{") and '"event": "request"' in line:
                out.append(json.loads(line))
    return out


def run_page(up: Up, npm_bin: Path, home: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` (a page's bash block) run by bash in the stack's folder, with the CLIs on
    PATH (as `npm i -g` puts them) and ``home`` as HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV)}
    env.update(HOME=str(home), PATH=f"{npm_bin}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(
        ["bash", "-c", up.text(script)],
        cwd=up.folder,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=150,
    )


def assert_round_trip(
    up: Up,
    upstream: Scripted,
    seen: int,
    logged: int,
    r: subprocess.CompletedProcess[str],
    kind: str,
    tool: str,
) -> None:
    """The CLI exited 0 quoting the command's output, which the upstream got back in a tool
    message after asking ``tool`` for the command, and the bridge logged the requests."""
    new = upstream.requests()[seen:]
    report = f"exit {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    tools = [[t["function"]["name"] for t in q.get("tools") or []] for q in new]
    assert r.returncode == 0, f"{report}\nupstream tools: {tools}"
    assert 'The command printed: "' in r.stdout and OUTPUT in r.stdout, report
    calls = [
        c
        for q in new
        for m in q["messages"]
        if m["role"] == "assistant"
        for c in m.get("tool_calls") or []
    ]
    assert calls and calls[0]["function"]["name"] == tool, (calls, tools)
    assert "$((6*7))" in calls[0]["function"]["arguments"]
    results = [
        m for q in new for m in q["messages"] if m["role"] == "tool" and OUTPUT in str(m["content"])
    ]
    assert results and results[0]["tool_call_id"] == calls[0]["id"], new[-1]["messages"]

    def served_now() -> list[dict[str, Any]]:
        return [x for x in bridge_requests(up)[logged:] if x.get("kind") == kind]

    # The bridge logs a request once its last byte is sent: the client may have exited first.
    wait_until(lambda: len(served_now()) >= 2, timeout=15, what="both requests in its log")
    served = served_now()
    assert len(served) >= 2, served
    assert all(x["status"] == 200 and x["model"] == "tokenbus-sim" for x in served), served


def test_codex_exec_runs_a_command_through_tokenbus(
    npm_bin: Path, stack: Up, upstream: Scripted, tmp_path: Path
) -> None:
    config = tmp_path / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text(stack.text(page_block("codex.md", "toml", "model_providers")))
    seen, logged = len(upstream.requests()), len(bridge_requests(stack))
    r = run_page(stack, npm_bin, tmp_path, page_block("codex.md", "bash", "codex exec"))
    assert_round_trip(stack, upstream, seen, logged, r, "responses", "exec_command")


def test_claude_code_print_mode_runs_a_command_through_tokenbus(
    npm_bin: Path, stack: Up, upstream: Scripted, tmp_path: Path
) -> None:
    seen, logged = len(upstream.requests()), len(bridge_requests(stack))
    r = run_page(stack, npm_bin, tmp_path, page_block("claude-code.md", "bash", "claude -p"))
    assert_round_trip(stack, upstream, seen, logged, r, "messages", "Bash")


def test_opencode_run_runs_a_command_through_tokenbus(
    npm_bin: Path, stack: Up, upstream: Scripted, tmp_path: Path
) -> None:
    config = tmp_path / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    config.write_text(stack.text(page_block("opencode.md", "json", "provider")))
    seen, logged = len(upstream.requests()), len(bridge_requests(stack))
    r = run_page(stack, npm_bin, tmp_path, page_block("opencode.md", "bash", "opencode run"))
    assert_round_trip(stack, upstream, seen, logged, r, "chat", "bash")


def test_system_messages_between_turns_become_chat_system_messages() -> None:
    # Claude Code 2.1.x sends its agent list as a system message after the first user turn.
    chat = to_messages(
        [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "agents: a, b"},
            {"role": "system", "content": [{"type": "text", "text": "x"}]},
        ]
    )
    assert chat[1:] == [
        {"role": "system", "content": "agents: a, b"},
        {"role": "system", "content": "x"},
    ]
