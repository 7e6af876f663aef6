"""nats-py's client, kept connected whatever one message holds.

nats-py (2.16) stops reading a connection for good when it fails on one incoming message:
its read loop ends on any exception, and nothing reconnects. Two messages any role may send
do that: one on a subject that is not UTF-8 (``tb.v1.req.\\xff`` reaches ingress' ``req.*``
subscription), and one whose header block starts with a status (``NATS/1.0 503``) followed by
bytes that are not UTF-8. The process would stay up, deaf to the bus. Here such text is
decoded with replacement characters, and a message that still fails is dropped and reported
to the connection's error callback, so the connection goes on reading.

nats-py also splits the server's ``MSG`` lines on any whitespace where the server separates
fields by spaces and tabs only: a subject holding a form feed or a vertical tab (which the
server passes) misparses, and nats-py drops the connection and reconnects, losing what was in
flight. The patterns are patched here (for every nats-py connection of the process) to split
as the server does.

Going out, the server closes the connection of a client that sends a command line longer
than 4 KiB (a subject taken from a message: a reply inbox, a replica's name) or headers and
payload together over ``max_payload`` (nats-py checks the payload alone). Such a publish is
refused here with nats-py's own error instead, before it is written.
"""

from __future__ import annotations

import re
from typing import Any

from nats import errors
from nats.aio.client import Client as NATS
from nats.protocol import parser

# The NATS server's default ``max_control_line``: ``HPUB <subject> <reply> <sizes>`` must fit.
MAX_CONTROL_LINE = 4096


# nats-py's own patterns (the same groups), with the server's separators instead of ``\s``.
parser.MSG_RE = re.compile(
    rb"\AMSG[ \t]+([^ \t\r\n]+)[ \t]+([^ \t\r\n]+)[ \t]+(([^ \t\r\n]+)[ \t]+)?(\d+)\r\n"
)
parser.HMSG_RE = re.compile(
    rb"\AHMSG[ \t]+([^ \t\r\n]+)[ \t]+([^ \t\r\n]+)[ \t]+(([^ \t\r\n]+)[ \t]+)?"
    rb"(\d+)[ \t]+(\d+)\r\n"
)


def _utf8(raw: bytes) -> bytes:
    """``raw`` with what is not UTF-8 replaced (U+FFFD)."""
    if raw.isascii():
        return raw
    return raw.decode("utf-8", "replace").encode()


class Client(NATS):
    """A nats-py client that one malformed message cannot stop."""

    async def _process_headers(self, headers: bytes) -> dict[str, str] | None:
        try:
            out: dict[str, str] | None = await super()._process_headers(headers)
        except UnicodeDecodeError:  # a status line's description is decoded strictly
            out = await super()._process_headers(_utf8(bytes(headers)))
        return out

    def _build_message(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: Any
    ) -> Any:
        return super()._build_message(sid, _utf8(subject), _utf8(reply), data, headers)

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(subject.encode()) + len(reply.encode()) + 64 > MAX_CONTROL_LINE:
            raise errors.BadSubjectError
        if headers:
            size = sum(len(k) + len(v.encode()) + 4 for k, v in headers.items()) + 12
            if size + len(payload) > self.max_payload:
                raise errors.MaxPayloadError
        await super().publish(subject, payload, reply, headers)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        try:
            await super()._process_msg(sid, subject, reply, data, headers)
        except Exception as exc:  # dropped: reading on matters more than this message
            await self._error_cb(exc)


async def connect(servers: str | list[str], **options: Any) -> NATS:
    """``nats.connect()`` with :class:`Client`."""
    nc = Client()
    await nc.connect(servers, **options)
    return nc
