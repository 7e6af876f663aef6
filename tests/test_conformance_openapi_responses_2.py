"""OpenAI's document's operation with the most cases, creating a response, against a stack of
its own: tests/test_conformance_openapi.py's check, in files apart so that no file takes over
90 s of a worker's time (docs/testing.md). Every case is generated in each of the three files,
and each sends a third of them (``in_shard``: a function of the request): this file the
second; the others are
test_conformance_openapi_responses.py, test_conformance_openapi_responses_3.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.fuzzstack import FuzzStack, in_shard
from tests.test_conformance_openapi import (
    RESPONSES,
    fuzz_stack,
    openai_schema,
    schema,
    served_as_documented,
    stored,
)

# The module-scoped fixtures, one stack for this file.
__all__ = ["fuzz_stack", "openai_schema", "stored"]


@pytest.mark.stack
@pytest.mark.timeout(600)
@schema.include(path_regex=RESPONSES).parametrize()
def test_openai_s_valid_responses_requests_are_served_as_openai_documents_2(
    case: Any, fuzz_stack: FuzzStack, stored: str
) -> None:
    if in_shard(case, 1, 3):
        served_as_documented(case, fuzz_stack, stored)
