#!/usr/bin/env python3
"""A newcomer's first five minutes, checked before anything else in CI (issue 63).

From a clean clone of this checkout's HEAD (or of ``--ref``), in a fresh virtual environment
made exactly as `make up` makes it (runtime install plus the ``client`` extra, no dev extras):

1. ``tokenbus <every sub-command> --help`` runs, nested sub-commands included;
2. `make up` is started in the background and waited for until ``/v1/models`` answers with the
   dev key it wrote;
3. the README's first examples run as printed: the ``openai`` SDK's streamed chat completion,
   the curl stream, and the NATS-native ``tokenbus.Client``;
4. Ctrl-C (SIGINT to `make up`'s process group, as a terminal sends it) stops the stack within
   a minute, and every process it started is gone.

Needs only Python 3.11+ and the package registry: it uses the standard library, and the
clone's own ``.venv`` for the SDKs. The stack listens on the README's ports (8000, 4222), so
they must be free; the check says so and stops if they are not. Exit status 0 when every step
passed; otherwise 1 with the step that failed and the tail of the stack's output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PORTS = (8000, 4222)  # the README's: the bridge, the embedded nats-server
UP_TIMEOUT_S = 600  # a fresh venv's install, then the stack's start


class Failed(Exception):
    pass


def step(msg: str) -> None:
    print(f"newcomer: {msg}", flush=True)


def run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENBUS_", "VIRTUAL_ENV"))}
    return subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def readme_blocks(readme: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", readme, flags=re.M | re.S)


def first_screen(readme: str) -> dict[str, str]:
    """The README's first examples, as printed: the openai SDK stream, curl, the NATS client."""
    py = readme_blocks(readme, "python")
    sdk = next(b for b in py if "from openai import OpenAI" in b and "stream=True" in b)
    nats = next(b for b in py if "from tokenbus import Client" in b)
    curl = next(b for b in readme_blocks(readme, "bash") if b.startswith("curl "))
    return {"openai SDK stream": sdk, "NATS client": nats, "curl stream": curl}


def help_of_every_command(clone: Path) -> int:
    """``tokenbus ... --help`` for every sub-command and nested sub-command."""
    code = (
        "import argparse, json\n"
        "from tokenbus.cli import build_parser\n"
        "def walk(p, path):\n"
        "    for a in p._actions:\n"
        "        if isinstance(a, argparse._SubParsersAction):\n"
        "            for name, sp in a.choices.items():\n"
        "                yield [*path, name]\n"
        "                yield from walk(sp, [*path, name])\n"
        "print(json.dumps(list(walk(build_parser(), []))))\n"
    )
    out = run([".venv/bin/python", "-c", code], clone)
    if out.returncode != 0:
        raise Failed(f"building the parser failed:\n{out.stderr}")
    commands = [[], *json.loads(out.stdout)]
    for argv in commands:
        r = run([".venv/bin/tokenbus", *argv, "--help"], clone, timeout=60)
        if r.returncode != 0 or "usage:" not in r.stdout:
            raise Failed(f"`tokenbus {' '.join(argv)} --help` failed:\n{r.stdout}{r.stderr}")
    return len(commands)


def wait_models(key_file: Path, proc: subprocess.Popen[bytes], log: Path) -> list[str]:
    deadline = time.monotonic() + UP_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Failed(f"`make up` exited ({proc.returncode}) before serving")
        if key_file.exists() and key_file.read_text().strip():
            req = urllib.request.Request(
                "http://127.0.0.1:8000/v1/models",
                headers={"Authorization": f"Bearer {key_file.read_text().strip()}"},
            )
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    models = [m["id"] for m in json.loads(r.read())["data"]]
                if models:
                    return models
                last = "no model listed yet"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = str(exc)
        time.sleep(0.5)
    raise Failed(f"/v1/models did not answer with the dev key in {UP_TIMEOUT_S}s ({last})")


def check_examples(clone: Path) -> None:
    examples = first_screen((clone / "README.md").read_text())
    for name, text in examples.items():
        if name == "curl stream":
            r = run(["bash", "-c", text], clone, timeout=60)
            ok = r.returncode == 0 and "data: [DONE]" in r.stdout and '"content"' in r.stdout
        else:
            r = run([".venv/bin/python", "-c", text], clone, timeout=60)
            ok = r.returncode == 0 and len(r.stdout.strip()) > 0
            if name == "NATS client":  # prints the finish reason and the replica of the whole
                ok = ok and re.search(r"\b(stop|length)\b", r.stdout) is not None
        if not ok:
            raise Failed(f"README example {name!r} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
        step(f"README example {name!r}: {r.stdout.strip().splitlines()[0][:70]!r}")


def stop(proc: subprocess.Popen[bytes], started: set[int], log: Path) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group."""
    started |= descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        raise Failed("`make up` did not exit within 90 s of Ctrl-C") from None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in started):
        time.sleep(0.2)
    left = sorted(p for p in started if alive(p))
    if left:
        raise Failed(f"processes of the stack still running after Ctrl-C: {left}")
    # make itself takes the SIGINT too and exits by it, as in a terminal; tokenbus up must
    # have stopped every service and said so.
    if proc.returncode not in (0, -signal.SIGINT, 128 + signal.SIGINT):
        raise Failed(f"`make up` exited {proc.returncode} on Ctrl-C")
    if "stopped." not in log.read_text(errors="replace").splitlines()[-1]:
        raise Failed("tokenbus up did not say `stopped.` as its last line after Ctrl-C")
    for port in PORTS:
        if port_taken(port):
            raise Failed(f"port {port} still answers after the stack stopped")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="HEAD", help="the commit to check (default HEAD)")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    a = ap.parse_args()
    for port in PORTS:
        if port_taken(port):
            print(f"newcomer: port {port} is taken; the README's `make up` needs it", flush=True)
            return 1
    work = Path(tempfile.mkdtemp(prefix="tokenbus-newcomer-"))
    clone = work / "tokenbus"
    log = work / "make-up.log"
    proc: subprocess.Popen[bytes] | None = None
    started: set[int] = set()
    try:
        subprocess.run(["git", "clone", "-q", str(HERE), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", a.ref], check=True)
        step(f"clean clone of {a.ref} in {clone}; `make up` (log: {log})")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENBUS_", "VIRTUAL"))}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["make", "up"],
                cwd=clone,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: Ctrl-C reaches all of it
            )
        models = wait_models(clone / ".tokenbus" / "dev-key", proc, log)
        started |= descendants(proc.pid)
        step(f"/v1/models answers with the dev key: {models}")
        dev = run([".venv/bin/python", "-c", "import pytest"], clone)
        if dev.returncode == 0:
            raise Failed("the newcomer's .venv has the dev extras (pytest): not `make up`'s")
        check_examples(clone)
        n = help_of_every_command(clone)
        step(f"`tokenbus ... --help` ran for {n} commands in the runtime-only environment")
        stop(proc, started, log)
        proc = None
        step("Ctrl-C stopped the stack: every process gone, ports 8000 and 4222 free")
        step("passed")
        return 0
    except (Failed, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"newcomer: FAILED: {exc}", flush=True)
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-40:]
            print("newcomer: the last lines of `make up`:\n  " + "\n  ".join(tail), flush=True)
        return 1
    finally:
        if proc is not None and proc.poll() is None:
            started |= descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in started:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        if a.keep:
            print(f"newcomer: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
