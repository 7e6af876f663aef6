"""Fuzz the bridge with bad keys and bad bodies (hypothesis): never a 5xx, every error in
OpenAI's shape, and every service still serving afterwards."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzzstack import FuzzStack, open_fuzz_stack
from tests.support.natsserver import NatsServer

pytestmark = pytest.mark.stack

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
fields = {
    "model": st.one_of(st.text(max_size=30), json_values),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "robot"]),
                    "content": st.one_of(st.text(max_size=50), json_values),
                }
            ),
            max_size=3,
        ),
        json_values,
    ),
    "max_tokens": st.one_of(st.integers(-5, 100), json_values),
    "temperature": st.one_of(st.floats(allow_nan=False), json_values),
    "stop": st.one_of(st.lists(st.text(max_size=5), max_size=6), json_values),
    "n": st.integers(-1, 3),
    "stream": st.booleans(),
    "stream_options": json_values,
}
bodies = st.one_of(
    st.fixed_dictionaries({}, optional=fields),
    json_values,
    st.binary(max_size=200),
)
# `make fuzz` raises the examples (docs/fuzzing.md); `make test` runs these floors.
EXAMPLES = int(os.environ.get("TOKENBUS_FUZZ_EXAMPLES") or 0)

latin1 = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80)
keys = st.one_of(
    st.none(),
    latin1,
    st.builds(lambda s: f"tb-{s}", latin1),
    st.just("tb-000000000000_" + "A" * 43),
)


@pytest.fixture(scope="module")
async def fuzz_stack(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FuzzStack]:
    env = {"TOKENBUS_BRIDGE__MAX_BODY_BYTES": "4096", "TOKENBUS_BRIDGE__BODY_TIMEOUT_S": "2"}
    async with open_fuzz_stack(
        nats_server.url,
        tmp_path_factory.mktemp("fuzz"),
        env,
        ("--sim-prefill-ms", "1", "--sim-decode-ms", "1"),
        rpm=100_000,
        tpm=10**9,
        max_concurrent=1000,
    ) as fs:
        yield fs


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "Traceback" not in err["message"]


@settings(
    max_examples=max(150, EXAMPLES),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=bodies,
    key=keys,
    use_real_key=st.booleans(),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
)
def test_bad_keys_and_bodies_never_5xx(
    fuzz_stack: FuzzStack, body: Any, key: str | None, use_real_key: bool, path: str
) -> None:
    headers = {"Content-Type": "application/json"}
    k = fuzz_stack.key if use_real_key else key
    if k is not None and k.strip():
        # HTTP itself forbids surrounding whitespace in a header value.
        headers["Authorization"] = f"Bearer {k.strip()}"
    if isinstance(body, dict) and use_real_key and "model" not in body:
        body = {**body, "model": fuzz_stack.model}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=fuzz_stack.base, timeout=30) as h:
        r = h.post(path, content=content, headers=headers)
    _check(r)


# Raw JSON text that Python objects serialized by json.dumps never hold: integers beyond 64
# bits, lone UTF-16 surrogate escapes, nesting deeper than tokenbus carries (1 500 levels
# also overflow the JSON parser's own recursion).
_raw_values = st.one_of(
    st.integers(min_value=2**64, max_value=2**200).map(str),
    st.integers(min_value=-(2**200), max_value=-(2**63) - 1).map(str),
    st.integers(min_value=0xD800, max_value=0xDFFF).map(lambda c: f'"x\\u{c:04x}y"'),
    st.integers(min_value=65, max_value=1500).map(lambda n: "[" * n + "]" * n),
)


@settings(
    max_examples=max(60, EXAMPLES // 4),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    value=_raw_values,
    field=st.sampled_from(["max_tokens", "temperature", "user", "metadata", "content"]),
)
def test_raw_json_beyond_what_tokenbus_carries_is_a_400_naming_the_field(
    fuzz_stack: FuzzStack, value: str, field: str
) -> None:
    if field == "content":
        body = (
            f'{{"model": "{fuzz_stack.model}", "messages": [{{"role": "user", '
            f'"content": {value}}}], "max_tokens": 2}}'
        )
        want = "messages.0.content"
    else:
        body = (
            f'{{"model": "{fuzz_stack.model}", "messages": [{{"role": "user", '
            f'"content": "hi"}}], "{field}": {value}}}'
        )
        want = field
    with httpx.Client(base_url=fuzz_stack.base, timeout=30) as h:
        r = h.post(
            "/v1/chat/completions",
            content=body.encode(),
            headers={"Authorization": f"Bearer {fuzz_stack.key}"},
        )
    _check(r)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if value.startswith("["):
        assert "nested deeper" in err["message"], err
    # The JSON parser's own recursion limit (some hundreds of levels, less the server's stack
    # in use) stops deeper bodies before any field is known; below it the field is named.
    if not value.startswith("[") or value.count("[") <= 500:
        assert err["param"] is not None and err["param"].startswith(want), err


def test_a_body_shorter_than_its_length_gets_408_and_the_connection_closes(
    fuzz_stack: FuzzStack,
) -> None:
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(fuzz_stack.base)
    with socket.create_connection((u.hostname, u.port), timeout=20) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n"
            b"Authorization: Bearer " + fuzz_stack.key.encode() + b"\r\n\r\n" + b'{"model"'
        )
        data = b""
        while chunk := s.recv(4096):  # until the server closes the connection
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_everything_still_serves_after_the_fuzzing(fuzz_stack: FuzzStack) -> None:
    fuzz_stack.assert_serving()
    for p in fuzz_stack.procs.procs:
        assert "Traceback" not in p.output(), p.name
        assert fuzz_stack.key not in p.output(), p.name
