"""The bridge's own OpenAPI document fuzzed on completions, against a stack of its own:
tests/test_fuzz_openapi.py's check, in a file apart so that no file takes over 90 s of a
worker's time (docs/testing.md)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.fuzzstack import FuzzStack
from tests.test_fuzz_openapi import (
    COMPLETIONS,
    api_schema,
    fuzz_stack,
    keeps_its_contract,
    schema,
    still_serving,
)

pytestmark = pytest.mark.stack

# The module-scoped fixtures, one stack for this file.
__all__ = ["api_schema", "fuzz_stack"]


@pytest.mark.timeout(600)
@schema.include(path_regex=COMPLETIONS).parametrize()
def test_the_bridge_keeps_its_openapi_contract_on_completions(
    case: Any, fuzz_stack: FuzzStack
) -> None:
    keeps_its_contract(case, fuzz_stack)


def test_everything_still_serves_after_the_fuzzing(fuzz_stack: FuzzStack) -> None:
    still_serving(fuzz_stack)
