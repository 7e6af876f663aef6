"""Endpoint groups: endpoints that share a subject builder and a queue group, so that a
service registers each one in one line (nats.py micro's ``add_group``/``add_endpoint``).

The group only names subjects and queue groups: the service it adds to wraps every
handler (a task per request, error replies, endpoint stats, tracing: services/runtime.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from typing import Protocol

from nats.aio.msg import Msg

Handler = Callable[[Msg], Awaitable[None]]


class AddEndpoint(Protocol):
    """What a group registers through: ``Service.add_endpoint`` (services/runtime.py)."""

    async def __call__(
        self, name: str, subject: str, handler: Handler, *, queue: str | None, member: bool
    ) -> None: ...


@dataclass(frozen=True)
class EndpointGroup:
    """Endpoints on ``prefix(name)`` in ``queue_group``; ``member``: their queue group's
    members beat and take requests on their own subjects too (services/members.py)."""

    add_endpoint: AddEndpoint
    prefix: Callable[[str], str] | None = None
    _: KW_ONLY
    queue_group: str | None = None
    member: bool = False

    async def add(
        self,
        name: str,
        handler: Handler,
        *,
        subject: str | None = None,
        member: bool | None = None,
    ) -> None:
        """Register ``handler`` as endpoint ``name``. Its subject is the group's prefix
        applied to ``name``, or ``subject`` whole (a group without a prefix needs one);
        ``member`` overrides the group's."""
        if subject is None:
            if self.prefix is None:
                raise ValueError(f"endpoint {name!r}: a group without a prefix needs a subject")
            subject = self.prefix(name)
        await self.add_endpoint(
            name,
            subject,
            handler,
            queue=self.queue_group,
            member=self.member if member is None else member,
        )
