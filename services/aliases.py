"""Model aliases: names clients ask for (``claude-sonnet-4-5``, ``gpt-5-codex``) mapped to the
models the bus serves.

Three sources, the first that names the asked model wins:

1. the API key's own ``aliases`` (``tokenbus keys update ID --alias NAME=MODEL``);
2. run-time aliases in the JetStream KV bucket ``tokenbus_aliases`` (``tokenbus router alias
   NAME MODEL``, ``PUT /v1/admin/routing/aliases/{name}``), watched by every auth stage, router
   and bridge, so a change reaches each within milliseconds and survives restarts;
3. the configuration, ``[router.aliases]`` (``TOKENBUS_ROUTER__ALIASES`` as JSON).

An alias is resolved once, one step (an alias never names another: refused when set), by the
auth stage (which then checks the key's allow-list: the alias name or the served model may
be on it) or, where the pipeline has no auth, by the router. The request goes on with the
served model in ``Tb-Model`` and in the envelope, and the name asked in ``Tb-Model-Alias``;
the answer carries the name asked (the bridge and the NATS client write the model of the
request they sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import check_envelope
from services import audit, bodies, buckets, kvmap

BUCKET = "tokenbus_aliases"
MAX_NAME = 256  # as a request's model


def _target(value: bytes) -> str | None:
    """An alias' target as stored (``{"model": ...}``); None when ``value`` is not one."""
    obj = kvmap.json_value(value)
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) and model else None


class AliasTable:
    """The global aliases: the configuration's, and the run-time ones from KV (which win)."""

    def __init__(self, static: Mapping[str, str] | None = None, log: Any = None) -> None:
        self.static = dict(static or {})
        self.log = log
        self._table = kvmap.Table(BUCKET, _target, log, "alias")

    @property
    def runtime(self) -> dict[str, str]:
        """The run-time aliases now, name -> served model."""
        return self._table.values

    def all(self) -> dict[str, str]:
        return {**self.static, **self.runtime}

    def resolve(self, model: str, own: Mapping[str, str] | None = None) -> str:
        """The served model ``model`` names: a key's ``own`` alias first, then a global one;
        ``model`` itself when it is no alias."""
        if own and model in own:
            return own[model]
        return self.runtime.get(model) or self.static.get(model) or model

    async def watch(self, nc: NATS) -> AliasTable:
        """Follow the bucket (created if missing); waits for its current values."""
        await self._table.watch(nc)
        return self

    async def close(self) -> None:
        await self._table.close()


async def watch_aliases(nc: NATS, static: Mapping[str, str], log: Any) -> AliasTable:
    """An alias table following the bucket; the configuration's only (and a warning) when
    the bus has no JetStream."""
    table = AliasTable(static, log)
    try:
        await table.watch(nc)
    except Exception as exc:
        log.warning("aliases_unavailable", error=str(exc))
    return table


def retarget(hdrs: dict[str, str], asked: str, served: str) -> bool:
    """When ``asked`` is an alias of ``served``, say so in ``hdrs`` (so no later stage
    resolves it again); whether it was (then the envelope's model must follow:
    :func:`envelope_for`)."""
    if served == asked:
        return False
    hdrs[H.MODEL_ALIAS] = asked
    hdrs[H.MODEL] = served
    return True


def envelope_for(data: bytes, env: dict[str, Any] | None, served: str) -> bytes:
    """The envelope ``data`` (decoded: ``env``, left as it is) with ``served`` as its model."""
    if env is None:
        env = codec.decode_map(data)
        check_envelope(env)
    return bodies.encode({**env, "model": served})


def rows(static: Mapping[str, str], runtime: Mapping[str, str]) -> list[dict[str, str]]:
    """Each global alias and where it comes from (a run-time one wins over the
    configuration's), by name."""
    out = {n: {"name": n, "model": m, "source": "config"} for n, m in static.items()}
    out.update({n: {"name": n, "model": m, "source": "runtime"} for n, m in runtime.items()})
    return [out[n] for n in sorted(out)]


# -- changes ---------------------------------------------------------------------------------
async def open_bucket(nc: NATS) -> KeyValue:
    return await kvmap.open_bucket(nc, BUCKET)


async def list_aliases(nc: NATS) -> dict[str, str]:
    """The run-time aliases now, name -> served model."""
    return await kvmap.entries(await open_bucket(nc), _target)


def check_alias(
    name: str,
    model: str,
    aliases: Mapping[str, str],
    served: Iterable[str],
    *,
    name_param: str = "name",
    model_param: str = "model",
) -> None:
    """Refuse (400, naming the field) ``name`` -> ``model`` beside ``aliases`` (the other
    aliases it would sit with) while ``served`` are the models the bus serves: no chain
    (``model`` an alias, or ``name`` the target of one) and no shadowing of a served model."""
    for value, param in ((name, name_param), (model, model_param)):
        if not value or len(value) > MAX_NAME:
            raise E.InvalidRequest(f"{param}: 1 to {MAX_NAME} characters", param=param)
    others = {n: t for n, t in aliases.items() if n != name}
    if model == name or model in others:
        raise E.InvalidRequest(
            f"{model_param}: {model!r} is an alias itself; an alias names a served model "
            f"(aliases do not chain){_aimed(model, others)}",
            param=model_param,
        )
    if name in set(served):
        raise E.InvalidRequest(
            f"{name_param}: {name!r} is a model the bus serves; an alias may not hide it",
            param=name_param,
        )
    pointing = sorted(n for n, t in others.items() if t == name)
    if pointing:
        raise E.InvalidRequest(
            f"{name_param}: the alias {pointing[0]!r} names {name!r}; an alias of it would "
            "make a chain (aliases do not chain)",
            param=name_param,
        )


def _aimed(model: str, aliases: Mapping[str, str]) -> str:
    target = aliases.get(model)
    return f"; name {target!r} instead" if target else ""


def check_key_aliases(
    own: Mapping[str, str], global_aliases: Mapping[str, str], served: Iterable[str]
) -> None:
    """A key's ``aliases`` as :func:`check_alias` checks each (their targets may not be a
    global alias either; a name may be one: the key's wins)."""
    served = set(served)
    for name, model in own.items():
        if model in global_aliases:
            raise E.InvalidRequest(
                f"aliases.{name}: {model!r} is an alias itself; an alias names a served model "
                f"(aliases do not chain){_aimed(model, global_aliases)}",
                param=f"aliases.{name}",
            )
        check_alias(
            name, model, own, served, name_param=f"aliases.{name}", model_param=f"aliases.{name}"
        )


async def set_alias(
    nc: NATS,
    name: str,
    model: str,
    *,
    actor: str | None = None,
    request_id: str | None = None,
) -> None:
    """``name`` serves ``model`` on every auth stage, router and bridge; with an ``actor``,
    audited (``alias.changed``, refused when the audit trail cannot be written). Check it
    with :func:`check_alias` first."""
    async with audit.change(nc, audit.ALIAS_CHANGED, name, actor, request_id=request_id) as c:
        kv = await open_bucket(nc)
        previous = await kvmap.current(kv, name, _target)
        data = json.dumps({"model": model}).encode()
        # Through a stalled stream leader too (a put is safe to repeat).
        await buckets.through_stall(lambda: kv.put(kvmap.kv_key(name), data), what="alias")
        c.details = {"model": model, "previous": previous}


async def remove_alias(
    nc: NATS, name: str, *, actor: str | None = None, request_id: str | None = None
) -> str | None:
    """Drop the run-time alias ``name`` (a configured one stays); audited like
    :func:`set_alias`. Returns the model it named, None when there was none."""
    async with audit.change(nc, audit.ALIAS_CHANGED, name, actor, request_id=request_id) as c:
        kv = await open_bucket(nc)
        previous = await kvmap.current(kv, name, _target)
        with contextlib.suppress(KeyNotFoundError):
            await kv.delete(kvmap.kv_key(name))
        c.details = {"model": None, "removed": True, "previous": previous}
    return previous


async def served_models(nc: NATS, wait_s: float = 1.5) -> set[str]:
    """The model names live replicas announce (models and their extra served names), from
    the heartbeats heard in ``wait_s`` (a process without a replica registry: the CLI)."""
    seen: set[str] = set()

    async def on_beat(msg: Any) -> None:
        with contextlib.suppress(Exception):
            hb = codec.decode_map(msg.data)
            seen.add(str(hb["model"]))
            seen.update(map(str, hb.get("aliases") or ()))

    sub = await nc.subscribe(subjects.heartbeat_wildcard(), cb=on_beat)
    try:
        await asyncio.sleep(wait_s)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return seen
