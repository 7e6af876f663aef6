"""How an operator command (status, keys, router, audit) reaches the bus, and says why not."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import nats
from nats.aio.client import Client as NATS

from services.runtime import is_auth_error, servers


async def connect(url: str, auth: dict[str, str] | None) -> NATS | None:
    """A connection for one command, or None once the reason is printed on stderr: a login
    the server refuses is told apart from a server that is not there."""
    refused: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        # nats-py reports the server's refusal here, then raises something vaguer.
        if is_auth_error(exc):
            refused.append(exc)

    try:
        # Bounded: nats-py, told not to reconnect, may still wait on a port nobody serves.
        return await asyncio.wait_for(
            nats.connect(
                servers(url),
                connect_timeout=3,
                allow_reconnect=False,
                error_cb=on_error,
                **(auth or {}),
            ),
            5,
        )
    except Exception as exc:
        if refused or is_auth_error(exc):
            print(refused_message(url, auth, refused[0] if refused else exc), file=sys.stderr)
        else:
            why = "no answer within 5 s" if isinstance(exc, TimeoutError) else str(exc)
            print(
                f"error: cannot reach NATS at {url} ({why}): is the stack up? `make up` starts "
                "one; TOKENBUS_NATS_URL or --nats-url names another",
                file=sys.stderr,
            )
        return None


def refused_message(url: str, auth: dict[str, Any] | None, exc: BaseException) -> str:
    """What to do when the NATS server at ``url`` refuses the login (not: is unreachable)."""
    user = (auth or {}).get("user")
    who = f"the login as {user!r}" if user else "a login without credentials"
    return (
        f"error: the NATS server at {url} refused {who} ({exc}). Run the command in the "
        "folder of the `tokenbus up` that runs it (or set TOKENBUS_UP__DATA_DIR to its data "
        "folder) so it finds the admin login in nats-locked/nats-users.json; elsewhere set "
        "TOKENBUS_NATS_USER and TOKENBUS_NATS_PASSWORD"
    )
