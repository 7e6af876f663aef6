"""The HTTP bridge running auth, ratelimit and filter in-process (``bridge.fuse_stages``):
same answers as the stage services, and the same shared state."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from auth.store import KeyStore
from bus_schemas import errors as E
from tests.support.procs import Procs, start_stack
from tests.support.waits import fresh_window, wait_started
from tokenbus import Client

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "hi"}]
AWS = "AKIA" + "IOSFODNN7EXAMPLE"
PIPELINE = '["auth", "ratelimit", "filter", "route"]'
STAGES = ("ingress", "auth", "ratelimit", "filter", "router")


@pytest.mark.parametrize("fuse", [True, False])
async def test_bridge_stages_share_limits_keys_and_policies_with_the_services(
    procs: Procs, model: str, fuse: bool, keys: KeyStore, client: Client
) -> None:
    key, rec = await keys.create("shared", rpm=4, filter_policy="strict")
    env = {
        "TOKENBUS_INGRESS__PIPELINE": PIPELINE,
        "TOKENBUS_FILTER__DEFAULT_POLICY": "strict",
        "TOKENBUS_BRIDGE__FUSE_STAGES": "true" if fuse else "false",
    }
    stack = await start_stack(procs, model, *STAGES, env=env)
    # Every stage service started (its key cache loaded: the key was made before) and has
    # heard the others and the replica.
    await wait_started(keys.nc, dict.fromkeys(STAGES, 1), model, 1)
    await fresh_window()
    api = stack.openai(key)
    # Two requests over HTTP (the bridge's limiter), two over NATS (the stage service's).
    for _ in range(2):
        r = await api.chat.completions.create(model=model, messages=MSG, max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2
    for _ in range(2):
        await client.chat_completion(model, MSG, max_tokens=2, api_key=key)
    with pytest.raises(E.RateLimited):
        await client.chat_completion(model, MSG, max_tokens=2, api_key=key)
    # The fifth over HTTP is refused too: the limit is the key's, not each instance's.
    with pytest.raises(openai.RateLimitError) as rl:
        await api.chat.completions.create(model=model, messages=MSG, max_tokens=2)
    assert rl.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(rl.value.response.headers["retry-after"]) >= 1
    # The key's strict policy blocks a secret in the prompt, naming the detector only.
    await keys.update(rec.id, rpm=1000)
    async with stack.http("/v1", timeout=30) as h:
        hdr = {"Authorization": f"Bearer {key}"}
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"key {AWS}"}],
            "max_tokens": 2,
        }
        # Refused for its rate (429) until the new limit reaches the limiter the bridge uses.
        deadline = time.monotonic() + 20
        while (r := await h.post("/chat/completions", json=body, headers=hdr)).status_code == 429:
            assert time.monotonic() < deadline, "the new rpm never reached the limiter"
            await asyncio.sleep(0.05)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "content_blocked.secret.aws_access_key"
        assert AWS not in r.text
        # Revoked: refused everywhere within moments.
        await keys.revoke(rec.id)
        for _ in range(40):
            r = await h.post("/chat/completions", json={**body, "messages": MSG}, headers=hdr)
            if r.status_code == 401:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert key not in r.text
    assert stack.all_alive(), "a process died"
