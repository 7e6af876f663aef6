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

import uuid
from collections.abc import Sequence
from typing import Any

import nats

from auth.keys import key_id_of
from bus_schemas import headers as H
from bus_schemas import subjects
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

__all__ = ["Chunk", "Client", "Completion", "EmbeddingResult", "Stream", "Usage"]


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
        (``user``/``password`` for a role login, ``tls`` for an SSL context of your own)."""
        options.setdefault("name", "tokenbus-client")
        options.setdefault("max_reconnect_attempts", -1)
        options.setdefault("dont_randomize", True)  # several URLs: the first is preferred
        holder: list[Client] = []

        async def reconnected() -> None:
            if holder:
                holder[0].connection_broke()

        options.setdefault("reconnected_cb", reconnected)
        if tls_ca:
            options.setdefault("tls", client_context(tls_ca, tls_cert or "", tls_key or ""))
        prefix = None
        if api_key:
            options.setdefault("token", api_key)
            key_id = key_id_of(api_key)
            if key_id:  # the only place the server lets a key's connection subscribe
                prefix = f"{subjects.key_inbox_root(key_id)}.{uuid.uuid4().hex}"
        # Several URLs separated by commas: the nodes of a cluster.
        nc = await nats.connect([u.strip() for u in url.split(",") if u.strip()], **options)
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
        **params: Any,
    ) -> Stream:
        """Stream a chat completion; ``params`` are OpenAI's (max_tokens, temperature, tools,
        tool_choice, response_format, logprobs, ...; fields tokenbus does not know are carried
        to the engine). ``session`` keys session-affinity routing (requests of one session,
        one replica). Chunks carry ``tool_calls``/``logprobs``/``refusal``/``reasoning`` when
        the engine sends them; :meth:`Stream.collect` puts them together."""
        body = {"model": model, "messages": list(messages), **params}
        return self.submit(
            subjects.KIND_CHAT,
            body,
            timeout=timeout,
            api_key=api_key or self.api_key,
            request_id=request_id,
            headers={H.SESSION: session} if session else None,
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
        **params: Any,
    ) -> Stream:
        """Stream a text completion."""
        body = {"model": model, "prompt": prompt, **params}
        return self.submit(
            subjects.KIND_COMPLETIONS,
            body,
            timeout=timeout,
            api_key=api_key or self.api_key,
            request_id=request_id,
            headers={H.SESSION: session} if session else None,
        )

    async def chat_completion(
        self, model: str, messages: Sequence[dict[str, Any]], **kwargs: Any
    ) -> Completion:
        """A whole chat completion (non-streaming)."""
        return await self.chat(model, messages, **kwargs).collect()

    async def completion(self, model: str, prompt: str, **kwargs: Any) -> Completion:
        """A whole text completion (non-streaming)."""
        return await self.completions(model, prompt, **kwargs).collect()

    async def embeddings(
        self,
        model: str,
        input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        request_id: str | None = None,
        **params: Any,
    ) -> EmbeddingResult:
        """Embed ``input`` (a string, strings, or token id lists) with an embedding model;
        ``params`` are OpenAI's (``dimensions``, ``user``, ...). Vectors come back as floats."""
        body = {"model": model, "input": input if isinstance(input, str) else list(input)}
        body.update(params)
        stream = self.submit(
            subjects.KIND_EMBEDDINGS,
            body,
            timeout=timeout,
            api_key=api_key or self.api_key,
            request_id=request_id,
        )
        return await stream.collect_embeddings()
