"""A process started by the ``tokenbus`` command imports the bus's libraries without the
optional extras they load on import and tokenbus never uses.

Every service is a process, and every test stack, restart and scale-out starts some: what
each one imports at start is paid each time, in CPU and in time to ready. Two imports
that cost about a quarter of a service's start (``python -X importtime``, docs/testing.md)
bring nothing to tokenbus:

* nats-py imports aiohttp (when installed) for its websocket transport, and aiohttp builds
  its TLS contexts as it is imported (reading the system's CA store): about 130 ms. tokenbus
  connects with ``nats://`` and ``tls://`` only; a ``ws://`` server URL fails with
  nats-py's own "aiohttp not installed" error. aiohttp stays importable: the openai backend,
  the console and the benchmarks import it when they use it.
* structlog imports rich (when installed: the dev extras bring it) for its console renderer's
  tracebacks: about 100 ms. Without it the console renderer prints plain tracebacks, as it
  does in a runtime install, which has no rich; JSON logs do not change.

:func:`import_bus_libraries` runs first in :mod:`tokenbus.cli` (only there: an application
that imports ``tokenbus`` as a library keeps its own choice of extras). Where nats-py or
structlog is already imported, it changes nothing.
"""

from __future__ import annotations

import importlib
import sys

# The library, and what it may import on its own that a tokenbus process does not need.
HIDDEN = {"nats": ("aiohttp",), "structlog": ("rich",)}


def import_bus_libraries() -> None:
    """Import nats-py and structlog with their unused extras hidden (:data:`HIDDEN`)."""
    for library, extras in HIDDEN.items():
        if library in sys.modules:
            continue
        hidden = [name for name in extras if name not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises
        try:
            importlib.import_module(library)  # nats' package imports its client and transport
        finally:
            for name in hidden:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]
