"""Large request bodies without page faults: glibc's allocator keeps their memory mapped.

A 4 MiB request passes through several buffers of its size in each process it crosses (the
socket's bytes, the parsed text, the encoded parts, the engine's JSON). glibc gives a
block that large a mapping of its own (above its mmap threshold: 128 KiB to start, raised
as such blocks are freed) or heap memory that it hands back to the system once more than
its trim threshold is free at the heap's top. Either way the next request's buffers touch
pages the kernel must fault in again, on the request's path. Measured on the 2-core
development VM (``docs/large-requests.md``, "Memory kept mapped"): orjson parsing a freshly
read 4 MiB body took 5.2 ms (median of 30, the process idle between) with glibc's defaults
and 3.5 ms with the memory kept.

:func:`keep_freed` makes every block under :data:`OWN_MAPPING` come from the heap
(``M_MMAP_THRESHOLD``) and keeps up to ``keep_mb`` MiB of freed heap mapped
(``M_TRIM_THRESHOLD``). The price is memory: a process keeps up to that much beyond what it
uses, once a burst of large requests has needed it (``malloc_keep_mb``,
``TOKENBUS_MALLOC_KEEP_MB``; 0 leaves glibc's defaults). A block of :data:`OWN_MAPPING` or
more still gets a mapping of its own, handed back when freed: a vLLM worker's buffers while
it loads weights (gigabytes) do not stay in its heap. Python's small objects are not
affected (they live in its own arenas). Elsewhere than glibc (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks this large or larger get a mapping of their own. At 32 MiB the parse of a 4 MiB body
# still took 4.7 ms (orjson's work area for it is larger), at 64 MiB 3.5 ms, as with no
# mapping per block at all.
OWN_MAPPING = 64 * 1024 * 1024


def keep_freed(keep_mb: int) -> bool:
    """Tune this process's allocator as the module says; whether it was (glibc, and
    ``keep_mb`` over 0)."""
    if keep_mb <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    keep = min(keep_mb, 2047) * 1024 * 1024  # an int for mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, OWN_MAPPING)) and bool(mallopt(M_TRIM_THRESHOLD, keep))
