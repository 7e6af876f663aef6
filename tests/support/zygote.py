"""The fork server's own process (``python -m tests.support.zygote``): it imports the
project's service modules once, then forks a child for each service a test starts
(tests/support/forkserver.py), which runs ``tokenbus <args>`` exactly as ``python -m
tokenbus.cli <args>`` does, minus the interpreter's start and the imports.

Requests come on stdin, one JSON object a line: ``{"id", "args", "env", "cwd", "log"}``
(and ``"err"``: standard error apart from the output).
Answers go on stdout, one a line: ``{"id", "pid"}`` once the child is forked, ``{"exit":
pid, "code": returncode}`` when a child ends (the zygote is its parent and reaps it;
``code`` as ``subprocess.Popen.returncode`` has it: negative for a signal). A child returns
from :func:`serve` into :func:`main`, leaves the zygote's loop behind, and runs the command
as the main module of a fresh ``python -m``: its exit, its exceptions and its ``atexit``
handlers are the interpreter's own.
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import sys
from typing import Any

# The module of each service ``tokenbus serve`` runs (tokenbus/cli's ``_serve``).
SERVICE_MODULES = (
    "gateway.bridge",
    "gateway.ingress",
    "auth.service",
    "auth.ratelimit",
    "filter.service",
    "router.service",
    "telemetry.service",
    "engine_worker.worker",
)
# What a service imports before it serves, imported here once. Nothing that starts a thread
# or a loop at import; no optional extra (the openai backend's aiohttp): a child imports
# those itself, as a fresh process would.
PRELOAD = (
    "tokenbus.cli",  # first: it imports nats-py and structlog without their extras
    "services.runtime",
    *SERVICE_MODULES,
    "engine_worker.backends.sim",
    "uvloop",
)


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # The sub-commands' modules the parser imports for their options.
    sys.modules["tokenbus.cli"].build_parser()


def _answer(out: Any, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def serve() -> dict[str, Any]:
    """Fork a child per request until stdin closes (then exit); in a child, return its
    request."""
    out = os.fdopen(os.dup(1), "w")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through wake_w
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _reap(out)
                continue
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                os._exit(0)  # the test process is gone: its children stay to be stopped
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for fd in (wake_r, wake_w, out.fileno()):
                        os.close(fd)
                    return dict(job)
                _answer(out, {"id": job["id"], "pid": pid})


def _reap(out: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer(out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(job: dict[str, Any]) -> None:
    """The child: the request's environment, directory, output and arguments."""
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, job["log"]), (2, job.get("err") or job["log"])):
        out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    import tokenbus.cli

    main_file = os.path.join(os.path.dirname(tokenbus.cli.__file__), "__main__.py")
    sys.argv = [main_file, *job["args"]]


def main() -> None:
    _preload()
    job = serve()
    _become(job)
    runpy.run_module("tokenbus.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
