"""The images' locked versions: ``constraints.txt`` pins every package ``pip install .``
brings (tokenbus' dependencies and theirs, as installed in this environment, the one the
tests ran in), so an image built later gets the versions that were tested, not whatever
the open ranges of pyproject.toml allow that day. Both Dockerfiles install with
``-c constraints.txt``; ``make lock`` writes it again after a dependency changes;
``tests/test_versions.py`` fails when it drifts from what is installed.

(A build tool: it reads the environment, never runs in a service or the ``tokenbus`` command.)
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = (
    "# The versions the images install (`pip install -c constraints.txt .`): tokenbus'\n"
    "# dependencies and theirs as tested. Written by `make lock`; tests/test_versions.py\n"
    "# checks it against the environment.\n"
)


def closure(root: str = "tokenbus", extras: tuple[str, ...] = ()) -> dict[str, str]:
    """Every package ``root`` needs (its extras ``extras`` included), by canonical name:
    its installed version."""
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    out: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        dist = metadata.distribution(name)
        for spec in dist.requires or []:
            req = Requirement(spec)
            marker = req.marker
            if marker is not None and not any(
                marker.evaluate({**env, "extra": e}) for e in (*wanted, "")
            ):
                continue
            key = canonicalize_name(req.name)
            if key in out:
                continue
            try:
                out[key] = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                continue  # not on this platform
            todo.append((req.name, tuple(req.extras)))
    out.pop(canonicalize_name(root), None)
    return dict(sorted(out.items()))


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in pins.items())


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "constraints.txt")
    path.write_text(render(closure()))
    print(f"wrote {path}: {len(closure())} packages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
