"""A real server fault is a 500 that names nothing internal, and the operator finds it: one
log line at level error with the request id and the traceback."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import structlog

from gateway.openai_api import OpenAIApp

pytestmark = pytest.mark.unit


class BrokenSource:
    """A source whose request path fails with a bug (not a TokenbusError)."""

    def open(self, *a: Any, **kw: Any) -> Any:
        raise RuntimeError("a bug in the gateway")

    def models(self) -> list[str]:
        return ["m"]

    def models_for(self, api_key: str | None) -> list[str]:
        return ["m"]

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return True


async def test_a_server_fault_is_a_500_logged_at_error_with_the_request_id_and_traceback() -> None:
    app = OpenAIApp(BrokenSource(), max_body_bytes=4096, request_timeout_s=5)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    with structlog.testing.capture_logs() as logs:
        async with httpx.AsyncClient(transport=transport, base_url="http://bridge") as h:
            r = await h.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"x-request-id": "req-500"},
            )
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal_error" and "bug" not in err["message"]
    faults = [e for e in logs if e["event"] == "internal_error"]
    assert len(faults) == 1
    assert faults[0]["log_level"] == "error" and faults[0]["request_id"] == "req-500"
    assert faults[0].get("exc_info") is True  # the traceback goes with the line
    # Client mistakes are not faults: a bad body is a 400 and logs no error.
    with structlog.testing.capture_logs() as logs:
        async with httpx.AsyncClient(transport=transport, base_url="http://bridge") as h:
            r = await h.post("/v1/chat/completions", content=b'{"model": "m", "x": [[[')
    assert r.status_code == 400
    assert not [e for e in logs if e.get("log_level") == "error"]
