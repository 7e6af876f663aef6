"""A scripted OpenAI-compatible chat upstream that drives a coding agent through one tool
call: the model a coding CLI (Codex, Claude Code, ...) talks to, through tokenbus.

    python -m tests.fakes.scripted_upstream --port 8124

``POST /v1/chat/completions`` (streamed or whole):

* with a shell tool among ``tools`` (by name: ``Bash``, ``shell``, ``exec_command``, ...)
  and no ``tool`` message yet: a call to that tool running :data:`COMMAND`, with the
  arguments in the tool's own schema (``command`` as an argv list or a string, or ``cmd``);
* with a ``tool`` message: a final text quoting that message's content (the tool's real
  output, as the client sent it back);
* anything else (a client's side request without tools: a title, a summary): ``ok``.

``GET /v1/models`` lists :data:`MODEL`; ``GET /v1/requests`` returns every POST body
received, in order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from aiohttp import web

MODEL = "scripted-model"
COMMAND = "echo tokenbus-$((6*7))"
SHELL_TOOLS = ("Bash", "shell", "exec_command", "shell_command", "local_shell", "bash")


def shell_tool(tools: Any) -> dict[str, Any] | None:
    """The chat tool among ``tools`` that runs a shell command, if any."""
    by_name = {
        (t.get("function") or {}).get("name"): t.get("function") or {}
        for t in tools or []
        if isinstance(t, dict)
    }
    return next((by_name[n] for n in SHELL_TOOLS if n in by_name), None)


def arguments(tool: dict[str, Any]) -> dict[str, Any]:
    """Arguments that run :data:`COMMAND` in ``tool``'s parameter schema."""
    props = (tool.get("parameters") or {}).get("properties") or {}
    key = "command" if "command" in props or "cmd" not in props else "cmd"
    if (props.get(key) or {}).get("type") == "array":
        return {key: ["bash", "-lc", COMMAND]}
    args: dict[str, Any] = {key: COMMAND}
    if "description" in props:
        args["description"] = "Print a greeting"
    return args


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


class ScriptedUpstream:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/requests", self.all_requests)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}
        )

    async def all_requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.requests)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        messages = body.get("messages") or []
        results = [m for m in messages if isinstance(m, dict) and m.get("role") == "tool"]
        tool = shell_tool(body.get("tools"))
        call: dict[str, Any] | None = None
        if results:
            text = f'The command printed: "{text_of(results[-1].get("content")).strip()}"'
        elif tool is not None:
            text = ""
            call = {
                "id": f"call_scripted_{len(self.requests)}",
                "type": "function",
                "function": {"name": tool["name"], "arguments": json.dumps(arguments(tool))},
            }
        else:
            text = "ok"
        finish = "tool_calls" if call else "stop"
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        head = {"id": f"chatcmpl-s{len(self.requests)}", "created": int(time.time())}
        head["model"] = body.get("model") or MODEL
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if call:
                message["tool_calls"] = [call]
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return web.json_response(
                {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            )
        delta: dict[str, Any] = {"role": "assistant", "content": text}
        if call:
            delta["tool_calls"] = [{"index": 0, **call}]
        chunks = [
            {"index": 0, "delta": delta, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": finish},
        ]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for choice in chunks:
            chunk = {**head, "object": "chat.completion.chunk", "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A scripted chat upstream for coding agents.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args(argv)
    # run_app ends on SIGTERM and SIGINT.
    web.run_app(ScriptedUpstream().app(), host=args.host, port=args.port, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
