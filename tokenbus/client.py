"""The NATS-native tokenbus client: ``from tokenbus import Client``.

One wildcard inbox subscription per client carries the frames of every request; each
request is an async iterator of chunks. Closing the iterator early cancels the request
on the replica serving it.

    async with await Client.connect("nats://127.0.0.1:4222") as tb:
        async for chunk in tb.chat("sim-small", [{"role": "user", "content": "hi"}]):
            print(chunk.text, end="")

The stream machinery (heartbeat watchdog, resends, migration, cancel) is the kit's
:class:`services.caller.Caller`, which the HTTP bridge uses too; this class adds the
connection and the calls users make.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from nats.errors import MaxPayloadError, NoRespondersError

from auth.keys import key_id_of
from bus_schemas import codec, frames, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from dialects import anthropic as M
from dialects import responses as R
from dialects.anthropic import MessageStream
from dialects.responses import ResponseStream
from services import natsclient, tracing
from services.caller import (
    DEFAULT_TIMEOUT_S,
    Caller,
    Chunk,
    Completion,
    EmbeddingResult,
    Stream,
    Usage,
)
from services.tlsfiles import client_context

__all__ = [
    "Chunk",
    "Client",
    "Completion",
    "EmbeddingResult",
    "MessageStream",
    "ResponseStream",
    "Stream",
    "Usage",
]


class Client(Caller):
    """tokenbus over NATS: publish requests to ingress, read frames from a private inbox."""

    api_key: str | None = None

    @classmethod
    async def connect(
        cls,
        url: str = "nats://127.0.0.1:4222",
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        **options: Any,
    ) -> Client:
        """Connect to NATS and start a client that owns the connection.

        ``api_key``: log in to the locked bus of ``tokenbus up`` with a tokenbus API key (the
        server's auth callout checks it and scopes the connection to that key: requests out,
        its own inbox in); every request then carries it too. ``tls_ca``: a TLS bus
        (``tokenbus nats-config --tls``), trusting that CA (``tls_cert``/``tls_key``: the
        certificate to present where the bus wants mutual TLS). ``options`` are nats-py's
        (``user``/``password`` for a role login, ``tls`` for an SSL context of your own).

        A login the server refuses (a wrong, empty, revoked or expired key; a wrong password)
        raises :class:`~bus_schemas.errors.Unauthorized` (``invalid_api_key``) at once, not
        retried. A key revoked while connected closes the client: its open streams and every
        later call raise the same error, and it does not reconnect.

        Tracing: when the standard OTEL_* variables turn it on in this process (an
        ``OTEL_EXPORTER_OTLP_ENDPOINT``), every request is a client span, the child of the
        current span or of the ``traceparent`` passed to the call."""
        tracing.setup("client")
        options.setdefault("name", "tokenbus-client")
        options.setdefault("max_reconnect_attempts", -1)
        # As the services' connections: a server back from a pause or a restart is found
        # within half a second (nats-py's 2 s between tries to one server kept a stream that
        # rode out a stall waiting up to 4 s more after it).
        options.setdefault("reconnect_time_wait", 0.5)
        options.setdefault("dont_randomize", True)  # several URLs: the first is preferred
        holder: list[Client] = []

        async def reconnected() -> None:
            if holder:
                holder[0].connection_broke()

        their_closed = options.pop("closed_cb", None)

        async def closed() -> None:
            # Closed because the server refused the login on a reconnect (the key was revoked,
            # disabled or expired while connected, and the server kicked the connection).
            if holder and getattr(holder[0].nc, "refused", None) is not None:
                holder[0].refuse(_refusal(url, options))
            if their_closed is not None:
                await their_closed()

        options.setdefault("reconnected_cb", reconnected)
        options["closed_cb"] = closed
        if tls_ca:
            options.setdefault("tls", client_context(tls_ca, tls_cert or "", tls_key or ""))
        prefix = None
        if api_key:
            options.setdefault("token", api_key)
            key_id = key_id_of(api_key)
            if key_id:  # the only place the server lets a key's connection subscribe
                prefix = f"{subjects.key_inbox_root(key_id)}.{uuid.uuid4().hex}"
                # nats-py's request-reply (stored responses) answers there too.
                options.setdefault("inbox_prefix", subjects.key_inbox_root(key_id))
        # Several URLs separated by commas: the nodes of a cluster.
        servers = [u.strip() for u in url.split(",") if u.strip()]
        try:
            # A refused login is final: raised at once, not retried for ever.
            nc = await natsclient.connect(servers, refusal_is_final=True, **options)
        except natsclient.LoginRefused:
            raise _refusal(url, options) from None
        # A key's connection receives only its own inbox: no heartbeats, keepalives instead.
        client = cls(nc, own_connection=True, inbox_prefix=prefix, heartbeats=prefix is None)
        client.api_key = api_key
        holder.append(client)
        await client.start()
        return client

    def chat(
        self,
        model: str,
        messages: Sequence[dict[str, Any]],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        request_id: str | None = None,
        session: str | None = None,
        traceparent: str | None = None,
        fairness_id: str | None = None,
        whole: bool = False,
        **params: Any,
    ) -> Stream:
        """Stream a chat completion; ``params`` are OpenAI's (max_tokens, temperature, tools,
        tool_choice, response_format, logprobs, ...; fields tokenbus does not know are carried
        to the engine). ``session`` keys session-affinity routing (requests of one session,
        one replica). ``traceparent``: a W3C trace context the request continues (every hop
        it takes is a span of that trace). ``fairness_id``: which of the key's agents or
        sessions the request is, for fair shares within the key (docs/flow.md);
        ``service_tier`` (OpenAI's) asks for a class. Chunks carry ``tool_calls``/``logprobs``/
        ``refusal``/``reasoning`` when the engine sends them; :meth:`Stream.collect` puts
        them together. ``whole``: the answer is collected, not shown as it comes: the replica
        sends its text in one chunk with the end (fewer messages; what
        :meth:`chat_completion` asks for)."""
        body = {"model": model, "messages": list(messages), **params}
        return self.submit(
            subjects.KIND_CHAT,
            body,
            timeout=timeout,
            api_key=api_key or self.api_key,
            request_id=request_id,
            headers=_headers(session, traceparent, fairness_id, whole),
        )

    def completions(
        self,
        model: str,
        prompt: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        request_id: str | None = None,
        session: str | None = None,
        traceparent: str | None = None,
        fairness_id: str | None = None,
        whole: bool = False,
        **params: Any,
    ) -> Stream:
        """Stream a text completion (``traceparent``: as for :meth:`chat`)."""
        body = {"model": model, "prompt": prompt, **params}
        return self.submit(
            subjects.KIND_COMPLETIONS,
            body,
            timeout=timeout,
            api_key=api_key or self.api_key,
            request_id=request_id,
            headers=_headers(session, traceparent, fairness_id, whole),
        )

    async def chat_completion(
        self, model: str, messages: Sequence[dict[str, Any]], **kwargs: Any
    ) -> Completion:
        """A whole chat completion (non-streaming)."""
        return await self.chat(model, messages, **{"whole": True, **kwargs}).collect()

    async def completion(self, model: str, prompt: str, **kwargs: Any) -> Completion:
        """A whole text completion (non-streaming)."""
        return await self.completions(model, prompt, **{"whole": True, **kwargs}).collect()

    def responses(
        self,
        model: str,
        input: str | Sequence[dict[str, Any]],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        request_id: str | None = None,
        session: str | None = None,
        traceparent: str | None = None,
        **params: Any,
    ) -> ResponseStream:
        """A Responses API request (``POST /v1/responses``'s body: ``input`` text or items,
        ``instructions``, ``tools``, ``text``, ``max_output_tokens``, ``store``,
        ``previous_response_id``, ...), streamed as the API's events (dicts with ``type`` and
        ``sequence_number``). It travels the chat path; stored responses are kept by ingress
        under the API key's id, as the bridge keeps those of HTTP clients
        (docs/responses.md). A bad field is refused here, before anything is sent."""
        body = {"model": model, "input": input if isinstance(input, str) else list(input)}
        body.update(params)
        key = api_key or self.api_key
        req = R.parse(body)
        if req.background:
            raise E.InvalidRequest(
                "a background response is made with Client.background_response (it returns "
                "at once; Client.get_response and response_events follow it)",
                param="background",
            )
        session = session or req.prompt_cache_key  # the session key routing keeps together
        submit = self._chat_sender(timeout, key, request_id, session, traceparent)
        return ResponseStream(req, body, submit, _Stored(self, key))

    def _chat_sender(
        self,
        timeout: float,
        api_key: str | None,
        request_id: str | None,
        session: str | None,
        traceparent: str | None,
    ) -> Callable[[dict[str, Any]], Stream]:
        """What sends a dialect's translated chat request down the chat path."""
        hdrs = _headers(session, traceparent)

        def submit(chat: dict[str, Any]) -> Stream:
            return self.submit(
                subjects.KIND_CHAT,
                chat,
                timeout=timeout,
                api_key=api_key,
                request_id=request_id,
                headers=hdrs,
            )

        return submit

    def messages(
        self,
        model: str,
        messages: Sequence[dict[str, Any]],
        *,
        max_tokens: int,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        request_id: str | None = None,
        session: str | None = None,
        traceparent: str | None = None,
        **params: Any,
    ) -> MessageStream:
        """An Anthropic Messages API request (``POST /v1/messages``'s body: ``messages`` with
        content blocks, ``system``, ``tools``, ``tool_choice``, ``stop_sequences``,
        ``thinking``, ...), streamed as the API's events (dicts with ``type``). It is
        translated by the same module as the bridge's (:mod:`dialects.anthropic`) and travels
        the chat path (docs/anthropic.md). A bad field is refused here, before anything is
        sent; a failure raises its typed error."""
        body = {"model": model, "messages": list(messages), "max_tokens": max_tokens, **params}
        submit = self._chat_sender(
            timeout, api_key or self.api_key, request_id, session, traceparent
        )
        return MessageStream(M.parse(body), body, submit)

    async def message(
        self, model: str, messages: Sequence[dict[str, Any]], **kwargs: Any
    ) -> dict[str, Any]:
        """A whole Messages API message object (non-streaming)."""
        return await self.messages(model, messages, **kwargs).collect()

    async def count_tokens(
        self,
        model: str,
        messages: Sequence[dict[str, Any]],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        **params: Any,
    ) -> int:
        """The input tokens of a Messages request (``POST /v1/messages/count_tokens``):
        counted by the engine that would serve it."""
        body = {"model": model, "messages": list(messages), **params}
        chat = M.count_request(M.translate(M.parse(body, count=True), body))
        submit = self._chat_sender(timeout, api_key or self.api_key, None, None, None)
        done = await submit(chat).collect()
        return done.usage.prompt_tokens

    async def response(
        self, model: str, input: str | Sequence[dict[str, Any]], **kwargs: Any
    ) -> dict[str, Any]:
        """A whole Responses API response object (non-streaming)."""
        return await self.responses(model, input, **kwargs).collect()

    async def get_response(self, response_id: str, *, api_key: str | None = None) -> dict[str, Any]:
        """A stored response (``GET /v1/responses/{id}``); 404 when it is not this key's."""
        rec = await _Stored(self, api_key or self.api_key).get(response_id)
        response: dict[str, Any] = rec["response"]
        return response

    async def response_input_items(
        self, response_id: str, *, api_key: str | None = None
    ) -> list[dict[str, Any]]:
        """The input items of a stored response's request, in order."""
        rec = await _Stored(self, api_key or self.api_key).get(response_id)
        return list(rec.get("input_items") or [])

    async def delete_response(self, response_id: str, *, api_key: str | None = None) -> None:
        """Delete a stored response (``DELETE /v1/responses/{id}``); 404 as for a get."""
        await _Stored(self, api_key or self.api_key).call(
            subjects.RESPONSES_DELETE, {"id": response_id}
        )

    # -- files and batches (docs/batches.md) ----------------------------------------------------
    def _batches(self, api_key: str | None, timeout: float = 30.0) -> _Stored:
        return _Stored(self, api_key or self.api_key, timeout, subjects.batches_state)

    async def files_create(
        self,
        data: bytes,
        filename: str = "batch.jsonl",
        *,
        purpose: str = "batch",
        api_key: str | None = None,
    ) -> dict[str, Any]:
        """Upload a file (``POST /v1/files``): a batch's input, JSONL. Over NATS a file must
        fit in one message (``max_payload``, 1 MiB by default); larger ones go over HTTP."""
        out = await self._batches(api_key).call(
            "file_create", {"data": bytes(data), "filename": filename, "purpose": purpose}
        )
        file: dict[str, Any] = out["file"]
        return file

    async def file(self, file_id: str, *, api_key: str | None = None) -> dict[str, Any]:
        """A file object (404 when it is not this key's)."""
        file: dict[str, Any] = (await self._batches(api_key).call("file_get", {"id": file_id}))[
            "file"
        ]
        return file

    async def file_content(self, file_id: str, *, api_key: str | None = None) -> bytes:
        """A file's bytes (a batch's output or error file, or an upload)."""
        out = await self._batches(api_key).call("file_content", {"id": file_id})
        return bytes(out["data"])

    async def files_delete(self, file_id: str, *, api_key: str | None = None) -> None:
        await self._batches(api_key).call("file_delete", {"id": file_id})

    async def files(
        self, *, purpose: str | None = None, api_key: str | None = None
    ) -> list[dict[str, Any]]:
        """This key's files, newest first."""
        out = await self._batches(api_key).call("file_list", {"purpose": purpose})
        return list(out["files"])

    async def batches_create(
        self,
        input_file_id: str,
        endpoint: str = "/v1/chat/completions",
        *,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        api_key: str | None = None,
    ) -> dict[str, Any]:
        """Make a batch of the file's requests (``POST /v1/batches``); it runs on the
        bridges' runners. :meth:`wait_batch` waits for its end."""
        body = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
            "metadata": metadata,
        }
        batch: dict[str, Any] = (await self._batches(api_key).call("create", body))["batch"]
        return batch

    async def batch(self, batch_id: str, *, api_key: str | None = None) -> dict[str, Any]:
        """A batch object: status, request_counts, output and error file ids."""
        batch: dict[str, Any] = (await self._batches(api_key).call("get", {"id": batch_id}))[
            "batch"
        ]
        return batch

    async def batches(self, *, api_key: str | None = None) -> list[dict[str, Any]]:
        """This key's batches, newest first."""
        return list((await self._batches(api_key).call("list", {}))["batches"])

    async def batches_cancel(self, batch_id: str, *, api_key: str | None = None) -> dict[str, Any]:
        batch: dict[str, Any] = (await self._batches(api_key).call("cancel", {"id": batch_id}))[
            "batch"
        ]
        return batch

    async def wait_batch(
        self,
        batch_id: str,
        *,
        timeout: float = 24 * 3600.0,
        poll_s: float = 1.0,
        api_key: str | None = None,
    ) -> dict[str, Any]:
        """The batch once it ended (completed, failed, expired, cancelled), asked every
        ``poll_s`` seconds; :class:`E.Timeout` after ``timeout``."""
        deadline = time.monotonic() + timeout
        status = "unknown"
        while True:
            try:
                b = await self.batch(batch_id, api_key=api_key)
            except E.TokenbusError as exc:
                if not exc.retryable:  # a node failing over: asked again
                    raise
            else:
                status = b["status"]
                if status in ("completed", "failed", "expired", "cancelled"):
                    return b
            if time.monotonic() >= deadline:
                raise E.Timeout(f"the batch is still {status} after {timeout:g}s")
            await asyncio.sleep(poll_s)

    async def background_response(
        self,
        model: str,
        input: str | Sequence[dict[str, Any]],
        *,
        api_key: str | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """A Responses API request run in the background (``background: true``): the
        ``queued`` response at once; a bridge's runner runs it (docs/batches.md).
        :meth:`get_response` shows where it stands, :meth:`response_events` follows its events,
        :meth:`response_cancel` stops it. A bad field is refused here, before anything is
        sent."""
        body: dict[str, Any] = {
            "model": model,
            "input": input if isinstance(input, str) else list(input),
            **params,
            "background": True,
        }
        R.parse(body)
        out = await self._batches(api_key).call("response_create", {"body": body})
        response: dict[str, Any] = out["response"]
        return response

    async def response_cancel(
        self, response_id: str, *, api_key: str | None = None
    ) -> dict[str, Any]:
        """Cancel a background response (a finished one is answered as it is)."""
        out = await self._batches(api_key).call("response_cancel", {"id": response_id})
        response: dict[str, Any] = out["response"]
        return response

    async def response_events(
        self,
        response_id: str,
        *,
        starting_after: int = -1,
        poll_s: float = 0.5,
        timeout: float = 24 * 3600.0,
        api_key: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """A background response's streaming events numbered after ``starting_after``, as
        they are kept, to the one that ends it: a client that went away resumes where it
        was. Asked of ingress every ``poll_s`` seconds while none are new."""
        deadline = time.monotonic() + timeout
        after, cursor = starting_after, 0  # cursor: where ingress reads on from
        state = self._batches(api_key)
        while True:
            try:
                out = await state.call(
                    "response_events",
                    {"id": response_id, "starting_after": after, "cursor": cursor},
                )
            except E.TokenbusError as exc:
                if not exc.retryable:
                    raise
                out = {"events": [], "ended": False, "cursor": cursor}
            cursor = int(out.get("cursor") or cursor)
            for ev in out["events"]:
                after = max(after, int(ev.get("sequence_number", after)))
                yield ev
                if ev.get("type") in _ENDINGS:
                    return
            if out["ended"] and not out["events"]:
                return  # its end was at or before ``starting_after``
            if time.monotonic() >= deadline:
                raise E.Timeout(f"the response has not ended after {timeout:g}s")
            if not out["events"]:
                await asyncio.sleep(poll_s)

    async def embeddings(
        self,
        model: str,
        input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        request_id: str | None = None,
        traceparent: str | None = None,
        **params: Any,
    ) -> EmbeddingResult:
        """Embed ``input`` (a string, strings, or token id lists) with an embedding model;
        ``params`` are OpenAI's (``dimensions``, ``user``, ...). Vectors come back as floats.
        ``traceparent``: as for :meth:`chat`."""
        body = {"model": model, "input": input if isinstance(input, str) else list(input)}
        body.update(params)
        stream = self.submit(
            subjects.KIND_EMBEDDINGS,
            body,
            timeout=timeout,
            api_key=api_key or self.api_key,
            request_id=request_id,
            headers=_headers(None, traceparent),
        )
        return await stream.collect_embeddings()


_ENDINGS = (
    "response.completed",
    "response.failed",
    "response.incomplete",
    "response.cancelled",
)


class _Stored:
    """A client's stored responses, asked of ingress by request-reply (docs/responses.md)."""

    def __init__(
        self,
        client: Client,
        api_key: str | None,
        timeout: float = 10.0,
        subject: Callable[[str], str] = subjects.responses_state,
    ) -> None:
        self.client = client
        self.api_key = api_key
        self.timeout = timeout
        self.subject = subject

    async def call(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        self.client.check_refused()
        try:
            msg = await self.client.nc.request(
                self.subject(action),
                codec.encode(body),
                timeout=self.timeout,
                headers={H.API_KEY: self.api_key} if self.api_key else None,
            )
        except NoRespondersError:
            raise E.ServiceUnavailable(
                "no tokenbus ingress is listening on this NATS server; start the stack "
                "(`tokenbus up`) or the ingress service"
            ) from None
        except TimeoutError:
            raise E.Timeout(f"ingress did not answer within {self.timeout:g}s; retry") from None
        except MaxPayloadError:
            raise E.PayloadTooLarge(
                "the request is larger than the bus carries (NATS max_payload: upload larger "
                "files over HTTP)"
            ) from None
        frame = codec.decode_map(msg.data)
        if frame.get("t") == frames.ERROR:
            raise E.TokenbusError.from_dict(frame.get("error") or {})
        return frame

    async def get(self, response_id: str) -> dict[str, Any]:
        rec: dict[str, Any] = (await self.call(subjects.RESPONSES_GET, {"id": response_id}))[
            "record"
        ]
        return rec

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        out = await self.call(subjects.RESPONSES_PUT, {"id": response_id, "record": record})
        return bool(out.get("stored"))


def _refusal(url: str, options: dict[str, Any]) -> E.Unauthorized:
    """The error of a login (``options``: nats-py's) the NATS server refused; it never holds
    the key itself."""
    api_key = options.get("token")
    if api_key:
        key_id = key_id_of(str(api_key))
        what = f"the API key {key_id}" if key_id else "the API key (not a tokenbus key)"
        why = (
            "it is unknown, revoked, disabled or expired (`tokenbus keys list` shows its "
            "state), or no tokenbus auth service answers logins on that bus"
        )
    elif options.get("user"):
        what, why = f"the user {options['user']!r}", "wrong password?"
    else:
        what, why = "a connection without a login", "pass api_key= (a tokenbus API key)"
    return E.Unauthorized(f"the NATS server at {url} refused {what}: {why}")


def _headers(
    session: str | None,
    traceparent: str | None,
    fairness_id: str | None = None,
    whole: bool = False,
) -> dict[str, str] | None:
    """The bus headers a call adds: its session key, the trace context it continues, its
    fairness id, and whether it takes the answer whole."""
    out: dict[str, str] = {}
    if whole:
        out[H.WHOLE] = "1"
    if session:
        out[H.SESSION] = session
    if fairness_id:
        out[H.FAIRNESS] = fairness_id[:128]
    if traceparent:
        tp = marks.traceparent(traceparent)
        if tp is None:
            raise E.InvalidRequest(
                f"traceparent {traceparent!r} is not a W3C traceparent "
                "(00-<32 hex trace id>-<16 hex span id>-<2 hex flags>)",
                param="traceparent",
            )
        out[H.TRACEPARENT] = tp
    return out or None
