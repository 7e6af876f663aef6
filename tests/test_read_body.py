"""The bridge's request body parser (gateway/asgi.py ``read_body``): a large body is parsed
with orjson first, and what orjson refuses is parsed again by the standard library, so a
large body is answered as a small one with the same JSON (the same value, the same 400)."""

from __future__ import annotations

from typing import Any

import pytest

from bus_schemas import errors as E
from gateway.asgi import _ORJSON_FROM, read_body

# JSON that orjson and the standard library may read differently.
VALUES = [
    "NaN",
    "-Infinity",
    "1e400",
    '"x\\ud800y"',
    str(2**64),
    str(2**70),
    str(2**64 - 1),
    str(-(2**63) - 1),
    "1e19",
    "-0",
    "[" * 70 + "]" * 70,
    '{"a": 1, "a": 2}',
    '"\\u00e9\\ud83d\\ude00"',
    "0.1",
]


def _receive(raw: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        assert not sent
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return receive


async def _outcome(raw: bytes) -> tuple[str, Any]:
    scope = {"type": "http", "headers": []}
    try:
        return "ok", await read_body(scope, _receive(raw), 64 * 1024 * 1024)
    except E.TokenbusError as err:
        return "error", (type(err), err.message.split(":")[0], err.param)


@pytest.mark.unit
@pytest.mark.parametrize("value", VALUES)
async def test_a_large_body_is_read_as_a_small_one(value: str) -> None:
    small = f'{{"v": {value}}}'.encode()
    pad = "p" * _ORJSON_FROM
    large = f'{{"v": {value}, "pad": "{pad}"}}'.encode()
    assert len(large) >= _ORJSON_FROM > len(small)
    kind_s, got_s = await _outcome(small)
    kind_l, got_l = await _outcome(large)
    assert kind_s == kind_l, (value, got_s, got_l)
    if kind_s == "ok":
        assert got_l.pop("pad") == pad
        assert repr(got_l) == repr(got_s)  # repr: NaN is not equal to itself
    else:
        assert got_s == got_l
