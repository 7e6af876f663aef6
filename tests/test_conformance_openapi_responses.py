"""OpenAI's document's operation with the most cases, creating a response, against a stack of
its own: tests/test_conformance_openapi.py's check, in files apart so that no file takes over
90 s of a worker's time (docs/testing.md). Every case is generated in each of the three files,
and each sends a third of them (``in_shard``: a function of the request): this file the
first; the others are
test_conformance_openapi_responses_2.py, test_conformance_openapi_responses_3.py."""

from __future__ import annotations

from tests.test_conformance_openapi import creation_shard, fuzz_stack, openai_schema, stored

# The module-scoped fixtures, one stack for this file.
__all__ = ["fuzz_stack", "openai_schema", "stored"]

test_openai_s_valid_responses_requests_are_served_as_openai_documents = creation_shard(0, 3)
