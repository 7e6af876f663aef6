"""Endpoint groups (services/endpoints.py): the subject, queue group and membership each
endpoint a group adds is registered with."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.msg import Msg

from bus_schemas import subjects
from services.endpoints import EndpointGroup
from services.runtime import Service

pytestmark = pytest.mark.unit

Added = list[tuple[str, str, str | None, bool]]


async def _handler(msg: Msg) -> None:
    return None


def _recorder(added: Added) -> Any:
    async def add_endpoint(
        name: str, subject: str, handler: Any, *, queue: str | None, member: bool
    ) -> None:
        added.append((name, subject, queue, member))

    return add_endpoint


def test_group_prefixes_names_and_carries_queue_and_membership() -> None:
    added: Added = []
    group = EndpointGroup(_recorder(added), subjects.stage, queue_group="q", member=True)
    asyncio.run(group.add("auth", _handler))
    asyncio.run(group.add("other", _handler, subject="whole.subject", member=False))
    assert added == [
        ("auth", subjects.stage("auth"), "q", True),
        ("other", "whole.subject", "q", False),
    ]


def test_group_without_prefix_needs_a_subject() -> None:
    group = EndpointGroup(_recorder([]), queue_group="q")
    with pytest.raises(ValueError, match="needs a subject"):
        asyncio.run(group.add("x", _handler))


def test_stage_endpoints_are_the_stage_subject_in_its_queue_group_as_members() -> None:
    added: Added = []
    svc = Service.__new__(Service)  # no connection: only the group is built
    svc.add_endpoint = _recorder(added)  # type: ignore[method-assign]
    for stage in subjects.STAGES:
        asyncio.run(svc.stage_endpoints(stage).add(stage, _handler))
    assert added == [(s, subjects.stage(s), s, True) for s in subjects.STAGES]
