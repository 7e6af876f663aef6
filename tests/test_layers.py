"""The layout's rule, checked: imports flow one way, contract → kit → actors → dialects →
jobs → gateway → face.

Every import in every module counts, including the lazy ones inside functions (a lazy
import is still a dependency; it only moves the cost to first use).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

# Each top-level folder and its layer; a module may import its own folder and folders of a
# lower layer only. Actors share a layer, so imports between actors are listed one by one.
LAYERS: dict[str, int] = {
    "bus_schemas": 0,  # the wire contract
    "services": 1,  # the kit every service uses
    "auth": 2,
    "filter": 2,
    "router": 2,
    "engine_worker": 2,
    "telemetry": 2,
    "dialects": 3,  # the API dialects (Anthropic's Messages, OpenAI's Responses) onto chat
    "jobs": 4,  # work that outlives a connection: batches, background responses, the stores
    "gateway": 5,  # ingress and the HTTP bridge
    "tokenbus": 6,  # the public client, the CLI, the launcher, the evaluation tools
}
# The worker scans its output stream with the filter's engine and publishes telemetry
# records; no other actor imports another.
ACTOR_IMPORTS = {("engine_worker", "filter"), ("engine_worker", "telemetry")}
# The contract is what every other part (and third parties) build on: no library beyond these.
THIRD_PARTY_OF = {
    "bus_schemas": {"msgpack", "pydantic"},
}


def unit_of(module: str) -> str | None:
    """The folder (a key of LAYERS) a dotted module name belongs to, None if outside."""
    top = module.split(".")[0]
    return top if top in LAYERS else None


def imports_of(path: Path) -> list[str]:
    """Absolute module names imported anywhere in ``path`` (relative imports resolved)."""
    return imports_in(path.read_text(), path.relative_to(ROOT).with_suffix("").parts[:-1])


def imports_in(source: str, pkg: tuple[str, ...]) -> list[str]:
    """Absolute module names imported anywhere in ``source``, a module of package ``pkg``."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            # ``from pkg import sub`` may name a submodule: count both readings.
            out.append(mod)
            out.extend(f"{mod}.{a.name}" for a in node.names)
    return out


def violations(module: str, imported: list[str]) -> list[str]:
    """What in ``imported`` breaks the rule for ``module``."""
    me = unit_of(module)
    assert me is not None and me in LAYERS, module
    bad: list[str] = []
    for name in imported:
        other = unit_of(name)
        if other is None or other == me:
            continue
        if LAYERS[other] > LAYERS[me]:
            bad.append(f"{module} imports {name} (layer {other} above {me})")
        elif LAYERS[other] == LAYERS[me] and (me, other) not in ACTOR_IMPORTS:
            bad.append(f"{module} imports {name} (actor {other} beside {me}, not allowed)")
    allowed = THIRD_PARTY_OF.get(me)
    if allowed is not None:
        for name in imported:
            top = name.split(".")[0]
            if unit_of(name) is None and top not in sys.stdlib_module_names | allowed:
                bad.append(f"{module} imports {name} (the contract uses only {sorted(allowed)})")
    return bad


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for unit in LAYERS:
        for path in (ROOT / unit).rglob("*.py"):
            mods[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return mods


def test_every_import_flows_down_the_layers() -> None:
    mods = project_modules()
    # Every unit is there (a rename that leaves LAYERS behind would check nothing).
    assert {unit_of(m) for m in mods} == set(LAYERS)
    bad = [v for mod, path in sorted(mods.items()) for v in violations(mod, imports_of(path))]
    assert bad == [], "\n".join(bad)


def test_no_top_level_folder_is_left_outside_the_layers() -> None:
    packages = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name != "tests"
    }
    assert packages == set(LAYERS)


def test_the_checker_catches_what_it_must() -> None:
    # An upward import, a lazy one, a sideways actor import, a relative one, and the contract
    # reaching for a client library are all caught; allowed imports are not.
    assert violations("services.runtime", ["telemetry.records"])
    assert violations("services.caller", ["gateway.bridge"])
    assert violations("bus_schemas.frames", ["services.caller"])
    assert violations("router.dispatch", ["auth.store"])
    assert violations("bus_schemas.codec", ["nats.aio.client"])
    assert not violations("engine_worker.worker", ["filter.scanner", "telemetry.records"])
    assert not violations("tokenbus.cli", ["gateway.bridge", "auth.store"])
    assert violations("dialects.anthropic", ["gateway.openai_api"])
    assert not violations("gateway.anthropic_api", ["dialects.anthropic", "services.caller"])
    assert not violations("tokenbus.client", ["dialects.anthropic"])
    assert violations("dialects.responses", ["jobs.response_store"])
    assert violations("jobs.batch_runner", ["gateway.openai_api"])
    assert not violations("gateway.bridge", ["jobs.batch_runner", "jobs.inprocess"])
    assert not violations("jobs.background", ["dialects.responses", "auth.store"])
    assert not violations("tokenbus.client", ["dialects.responses", "services.caller"])
    lazy = imports_in("def f():\n    from gateway import bridge\n", ("router",))
    assert violations("router.probe", lazy)
    relative = imports_in("from ..gateway import bridge\n", ("router",))
    assert "gateway.bridge" in relative
    assert violations("router.probe", relative)
    assert imports_in("from . import policies\n", ("router",)) == ["router", "router.policies"]
