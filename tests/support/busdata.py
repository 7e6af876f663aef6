"""What a test owns on a shared bus: a model name of its own, the API-key store."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import nats

from auth.store import KeyStore


def new_model() -> str:
    """A model name of its own, so tests sharing a bus do not see each other."""
    return f"m-{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def key_store(url: str, *, watch: bool = True) -> AsyncIterator[KeyStore]:
    """The API-key store on the bus at ``url``, on a connection of its own, for the block."""
    conn = await nats.connect(url)
    try:
        store = await KeyStore(conn).open(watch=watch)
        try:
            yield store
        finally:
            await store.close()
    finally:
        await conn.drain()
