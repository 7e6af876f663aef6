"""The bridge's own OpenAPI document fuzzed on completions, against a stack of its own:
tests/test_fuzz_openapi.py's check, in a file apart so that no file takes over 90 s of a
worker's time (docs/testing.md)."""

from __future__ import annotations

import pytest

from tests.test_fuzz_openapi import COMPLETIONS, api_schema, contract_tests, fuzz_stack

pytestmark = pytest.mark.stack

# The module-scoped fixtures, one stack for this file.
__all__ = ["api_schema", "fuzz_stack"]

(
    test_the_bridge_keeps_its_openapi_contract_on_completions,
    test_everything_still_serves_after_the_fuzzing,
) = contract_tests(COMPLETIONS)
