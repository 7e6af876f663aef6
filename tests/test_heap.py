"""services/heap.py: a service keeps freed memory mapped for the next large request."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from services.heap import keep_freed

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only"),
]

# Frees a block of argv[2] MiB after touching it, then says how many MiB of it stay resident.
PROBE = """
import sys
from services.heap import keep_freed
print("tuned" if keep_freed(int(sys.argv[1])) else "untuned")
def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20
before = rss_mb()
block = bytearray(int(sys.argv[2]) * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
del block
print(round(rss_mb() - before))
"""


def _probe(keep_mb: int, block_mb: int = 48) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(keep_mb), str(block_mb)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    ).stdout.split()
    return out[0], int(out[1])


def test_a_tuned_process_keeps_a_freed_large_block_mapped() -> None:
    state, kept_mb = _probe(256)
    assert state == "tuned"
    assert kept_mb >= 44  # the 48 MiB stayed: the next one faults no page in


def test_a_tuned_process_still_hands_back_a_block_past_its_own_mapping_size() -> None:
    """A block of OWN_MAPPING or more (a vLLM worker's while it loads weights) is not kept."""
    state, kept_mb = _probe(256, block_mb=96)
    assert state == "tuned"
    assert kept_mb < 8


def test_zero_leaves_glibcs_defaults_which_hand_a_large_block_back() -> None:
    state, kept_mb = _probe(0)
    assert state == "untuned"
    assert kept_mb < 8  # its own mapping, unmapped on free


def test_a_keep_of_zero_or_less_changes_nothing() -> None:
    assert keep_freed(0) is False
    assert keep_freed(-5) is False
