"""What the runtime install (`make up`'s `.[client]`, the images' plain `pip install .`) must
hold: every module the ``tokenbus`` command can import, followed from ``tokenbus.cli`` through
the project's own modules (imports inside functions included: a sub-command imports its work
when it runs), is the standard library, the project, or a package the runtime requirements
bring. Issue 63: the parser imported a bench module that imported httpx, a dev extra, and
`make up` crashed on a fresh machine while every test passed in the dev environment.

The imports that only an extra satisfies are named below with that extra, and each must sit
where nothing reaches it unless the extra's feature is chosen (vLLM, PostgreSQL, plots).
"""

from __future__ import annotations

import ast
import json
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.repo import ROOT
from tests.support.zygote import SERVICE_MODULES
from tokenbus.tools import lockfile

# The project's own top-level packages (pyproject.toml's [tool.setuptools] packages).
OWN = {"tokenbus", "bus_schemas", "services", "dialects", "jobs", "gateway", "auth", "filter",
       "router", "engine_worker", "telemetry"}  # fmt: skip

# Imports only an extra satisfies: module -> (extra, the distribution that extra names).
OPTIONAL = {
    "vllm": ("vllm", "vllm"),
    "torch": ("vllm", "vllm"),  # vLLM's own dependencies, where a vllm worker runs
    "transformers": ("vllm", "vllm"),
    "tokenizers": ("vllm", "vllm"),
    "zmq": ("vllm", "vllm"),
    "cbor2": ("vllm", "vllm"),
    "msgspec": ("vllm", "vllm"),
    "psycopg": ("postgres", "psycopg"),
    "matplotlib": ("report", "matplotlib"),
}


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] not in OWN:
        return None
    base = ROOT.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it, by absolute dotted name."""
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                root = ".".join([*base, node.module] if node.module else base)
            else:
                root = node.module or ""
            out.add(root)
            # ``from package import module`` imports the module too.
            out.update(f"{root}.{a.name}" for a in node.names)
    return out


def reachable(start: str = "tokenbus.cli") -> tuple[set[str], set[str]]:
    """(the project's modules reachable from ``start``, the outside modules they import)."""
    seen: set[str] = set()
    outside: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            if name.split(".")[0] not in OWN:
                outside.add(name.split(".")[0])
            continue
        seen.add(name)
        # A package's __init__ runs before any of its modules.
        parent = name.rpartition(".")[0]
        if parent:
            todo.append(parent)
        todo.extend(_imports(path, name))
    return seen, outside


def _distributions(module: str) -> set[str]:
    return {canonicalize_name(d) for d in metadata.packages_distributions().get(module, [])}


def _extra_requires(extra: str) -> set[str]:
    names = set()
    for spec in metadata.distribution("tokenbus").requires or []:
        req = Requirement(spec)
        if req.marker is not None and req.marker.evaluate({"extra": extra}):
            names.add(canonicalize_name(req.name))
    return names


@pytest.mark.unit
def test_every_module_the_command_can_import_is_in_the_runtime_install() -> None:
    own, outside = reachable()
    # The walk follows the lazy imports: the bench modules, every service, the backends.
    assert {"tokenbus.evaluation.nemesis", "engine_worker.worker", "gateway.bridge"} <= own
    runtime = set(lockfile.closure())  # what `pip install .` brings, by canonical name
    missing = {}
    for module in sorted(outside - set(sys.stdlib_module_names) - {"__future__"}):
        if module in OPTIONAL:
            continue
        dists = _distributions(module)
        if not dists & runtime:
            missing[module] = sorted(dists) or "not installed here either"
    assert not missing, f"imported by the command, not in its runtime requirements: {missing}"


@pytest.mark.unit
def test_each_optional_import_is_in_the_extra_that_names_it() -> None:
    _, outside = reachable()
    for module, (extra, dist) in OPTIONAL.items():
        assert canonicalize_name(dist) in _extra_requires(extra), (module, extra, dist)
    # The table names nothing the code no longer imports.
    assert set(OPTIONAL) <= outside, set(OPTIONAL) - outside


@pytest.mark.unit
def test_the_walk_catches_a_dev_only_import(tmp_path: Path) -> None:
    """The check itself: a module importing a dev-only package is found missing."""
    runtime = set(lockfile.closure())
    dev_only = {canonicalize_name(d) for d in _distributions("hypothesis")}
    assert dev_only and not dev_only & runtime
    assert "hypothesis" not in reachable()[1]


@pytest.mark.stack
def test_the_parser_imports_no_bench_module() -> None:
    """`tokenbus --help` (and every command's parser) loads no benchmark: their options live in
    tokenbus.evaluation.options, each scenario imported only when it runs."""
    import subprocess

    code = (
        "import sys, tokenbus.cli as c; c.build_parser(); "
        "print(','.join(sorted(m for m in sys.modules if m.startswith('tokenbus.evaluation'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.strip().split(","))
    assert loaded == {"tokenbus.evaluation", "tokenbus.evaluation.options"}, loaded


@pytest.mark.stack
def test_a_service_starts_without_the_extras_it_never_uses() -> None:
    """A process of the ``tokenbus`` command imports its service without aiohttp (nats-py's
    websocket transport; about 130 ms of every start) and without rich (structlog's console
    tracebacks; about 100 ms): services/lean_imports.py. Both still work where used: aiohttp
    imports after, the console renderer prints a traceback without rich, and nats-py refuses
    a ws:// server, saying why."""
    import subprocess

    code = (
        "import sys, json, asyncio, tokenbus.cli\n"
        f"for m in {SERVICE_MODULES!r}: __import__(m)\n"
        "loaded = sorted(m for m in ('aiohttp', 'rich') if m in sys.modules)\n"
        "import aiohttp, structlog, nats\n"
        "try:\n"
        "    raise ValueError('boom')\n"
        "except ValueError:\n"
        "    line = structlog.dev.ConsoleRenderer(colors=False)(None, 'error', "
        "{'event': 'x', 'exc_info': sys.exc_info()})\n"
        "async def ws():\n"
        "    try:\n"
        "        await asyncio.wait_for(nats.connect('ws://127.0.0.1:1', "
        "allow_reconnect=False, connect_timeout=1), 3)\n"
        "    except BaseException as exc:\n"
        "        return type(exc).__name__\n"
        "print(json.dumps({'loaded': loaded, 'aiohttp': bool(aiohttp.ClientSession), "
        "'traceback': 'ValueError: boom' in line, 'ws': asyncio.run(ws())}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [] and got["aiohttp"] and got["traceback"], got
    # No connection, and nats-py's reason on its error callback (stderr by default).
    assert got["ws"] and "Could not import aiohttp transport" in out.stderr, (got, out.stderr)
