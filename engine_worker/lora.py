"""A worker's LoRA adapters at run time (docs/adapters.md): load, unload (draining the
requests on the adapter first) and list, one change at a time, and which requests run on
which adapter."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from nats.aio.msg import Msg
from pydantic import ValidationError

from bus_schemas import codec
from bus_schemas import errors as E
from bus_schemas.messages import AdapterCommand
from engine_worker.replica import Replica


class Adapters:
    """The adapters one replica's engine holds, as its ``adapters`` subject changes them."""

    def __init__(self, worker: Replica) -> None:
        self.w = worker
        # The requests on each adapter (reply -> name), those draining to be unloaded and
        # those unloaded here (refused, so a router with an older view sends them elsewhere),
        # one change at a time.
        self._on_adapter: dict[str, str] = {}
        self.unloading: set[str] = set()
        self._unloaded: set[str] = set()
        self._left = asyncio.Event()
        self._lock = asyncio.Lock()

    def loaded(self) -> dict[str, str]:
        """The adapters the engine loaded at run time, name -> path (the backend's own map:
        read, never changed here)."""
        held = getattr(self.w.backend, "adapters", None)
        return held if isinstance(held, dict) else {}

    def refuses(self, model: str) -> bool:
        """Whether a request for ``model`` names an adapter unloading or unloaded here."""
        return model in self.unloading or model in self._unloaded

    def track(self, reply: str, model: str) -> None:
        """Note that the request answering to ``reply`` runs on ``model``, if an adapter."""
        if model != self.w.model and model in self.loaded():
            self._on_adapter[reply] = model

    def release(self, reply: str) -> None:
        """The request answering to ``reply`` ended: an unload waiting on it may go on."""
        if self._on_adapter.pop(reply, None) is not None:
            self._left.set()

    async def on_command(self, msg: Msg) -> None:
        """Load, unload or list adapters, one change at a time; the answer says what the
        replica holds after it, or the typed error naming this replica."""
        w = self.w
        t0 = time.monotonic()
        extra: dict[str, Any] = {}
        try:
            try:
                cmd = AdapterCommand.model_validate(codec.decode_map(msg.data))
            except ValidationError as exc:
                raise E.from_validation(exc) from None
            if cmd.op != "list":
                async with self._lock:
                    if cmd.op == "load":
                        await self._load(cmd.name, cmd.path)
                        extra["load_ms"] = round((time.monotonic() - t0) * 1000, 1)
                    else:
                        extra.update(await self._unload(cmd.name, cmd.drain_s))
            body: dict[str, Any] = {"ok": True, **extra}
        except E.TokenbusError as exc:
            body = {"ok": False, "error": exc.to_dict()}
        body.update(type="adapters", replica=w.replica, model=w.model, adapters=dict(self.loaded()))
        if w.own_reply(msg):
            with contextlib.suppress(Exception):
                await msg.respond(codec.encode(body))

    async def _load(self, name: str, path: str) -> None:
        w = self.w
        load = getattr(w.backend, "load_adapter", None)
        if not callable(load):
            raise E.InvalidRequest(
                f"replica {w.replica} (backend {w.backend.name}) cannot load adapters at run time",
                param="model",
            )
        if not name or not path:
            raise E.InvalidRequest("an adapter load names the adapter and its path", param="name")
        if name == w.model or (
            name in getattr(w.backend, "served_models", ()) and name not in self.loaded()
        ):
            raise E.InvalidRequest(
                f"{name!r} is a model replica {w.replica} serves already; an adapter needs "
                "a name of its own",
                param="name",
            )
        if self.loaded().get(name) == path:
            return  # loaded already, from the same place: done
        if w.draining or w.health.failure:
            raise E.ReplicaDraining(f"replica {w.replica} is not taking work")
        try:
            await load(name, path)
        except E.TokenbusError as exc:
            why = exc.message
            exc.message = f"replica {w.replica} could not load the adapter {name!r}: {why}"
            raise
        except Exception as exc:
            raise E.EngineError(
                f"replica {w.replica} could not load the adapter {name!r}: {exc}"
            ) from None
        self._unloaded.discard(name)
        w.log.info("adapter_loaded", adapter=name, path=path)
        await w.heartbeat()  # routers send its requests here from now

    async def _unload(self, name: str, drain_s: float) -> dict[str, int]:
        w = self.w
        if name not in self.loaded():
            raise E.NotFound(
                f"replica {w.replica} holds no adapter {name!r} loaded at run time",
                param="name",
            )
        # New requests go elsewhere at once (the beat, and the refusal of a late one); those
        # on it run on, for at most drain_s.
        self.unloading.add(name)
        try:
            await w.heartbeat()
            on = [r for r, n in self._on_adapter.items() if n == name]
            deadline = time.monotonic() + drain_s
            while any(self._on_adapter.get(r) == name for r in on):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._left.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._left.wait(), left)
            cut = [r for r in on if self._on_adapter.get(r) == name]
            for reply in cut:
                task = w._active.get(reply)
                if task is not None and not task.done():
                    task.cancel()  # ends as interrupted: its caller moves it on
            await w.backend.unload_adapter(name)  # type: ignore[attr-defined]
        finally:
            self.unloading.discard(name)
        self._unloaded.add(name)
        w.log.info("adapter_unloaded", adapter=name, drained=len(on) - len(cut), cut=len(cut))
        await w.heartbeat()
        return {"drained": len(on) - len(cut), "cut": len(cut)}
