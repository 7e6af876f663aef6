"""The shapes of what jobs keep on JetStream and send: batch records and objects, a batch's
input and work lines and their answers, file records, stored responses.

Each is a ``TypedDict``: at run time the plain dict it always was, so what is stored, queued
and answered is byte for byte what it was (the same keys, in the same order; ``None`` where a
value is null, a key left out where it was left out). The types say what each holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from jobs.batch_status import BatchStatus

if TYPE_CHECKING:  # for mypy only (typing has it from 3.13): annotations are not evaluated
    from typing_extensions import ReadOnly


# -- batches ----------------------------------------------------------------------------------
class BatchError(TypedDict):
    """One thing wrong with a batch (its input file; ``line`` counts from 1)."""

    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(TypedDict):
    """A failed batch's ``errors``."""

    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(TypedDict):
    """A batch's lines: all, answered 2xx, answered otherwise."""

    total: int
    completed: int
    failed: int


class BatchObject(TypedDict):
    """OpenAI's batch object, as the API returns it."""

    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchRecord(TypedDict):
    """A batch as kept in the KV bucket ``tokenbus_batches``: its object, its owner (a key
    id, ``""`` in an open deployment), its line count; while it is finished, how it ends
    and the runner finishing it."""

    owner: str
    batch: BatchObject
    total: int
    ending: NotRequired[Literal["completed", "cancelled"]]
    finalizer: NotRequired[str]


class InputLine(TypedDict):
    """A request of a batch's input file, as checked (``n`` counts from 0, ``line`` is its
    line in the file, from 1); read-only, as the file it came from."""

    n: ReadOnly[int]
    line: ReadOnly[int]
    custom_id: ReadOnly[str]
    body: ReadOnly[dict[str, Any]]


class ValidateWork(TypedDict):
    """A work message: check a new batch's input file and queue its lines."""

    batch: str


class LineWork(TypedDict):
    """A work message: run one line of a batch (an :class:`InputLine` and its url)."""

    batch: str
    n: int
    line: int
    custom_id: str
    body: dict[str, Any]
    url: str


class ResponseWork(TypedDict):
    """A work message: run a background response (``batch`` is the response's id)."""

    batch: str
    owner: str
    body: dict[str, Any]


class LineResponse(TypedDict):
    """What a line's request was answered."""

    status_code: int
    request_id: str
    body: Any


class LineError(TypedDict):
    """Why a line has no answer."""

    code: str
    message: str


class ResultLine(TypedDict):
    """A line of a batch's output or error file (OpenAI's shape), with ``ok`` and ``n`` for
    sorting (not written to the file)."""

    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None
    ok: bool
    n: int


# -- files ------------------------------------------------------------------------------------
class FileObject(TypedDict):
    """OpenAI's file object, as the API returns it."""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    status_details: None


class FileRecord(TypedDict):
    """A file's description in the object store: its owner and its file object."""

    owner: str
    file: FileObject


# -- stored responses -------------------------------------------------------------------------
class RunState(TypedDict, total=False):
    """Which run of a background response this is (a rerun pays for one answer)."""

    rid: str
    next: int
    attempt: int
    ticket: str


class LargeRef(TypedDict):
    """Where a record too large for KV is: its size and sha256 (the object store has it)."""

    size: int
    sha256: str


class ResponseEnd(TypedDict):
    """The event that ends a background response's events when its runner could not send
    the app's own (cancelled, failed before it ran, or ended while its events aged out)."""

    type: str
    response: dict[str, Any]
    sequence_number: int


class ResponseRecord(TypedDict, total=False):
    """A stored response (:func:`dialects.responses.record`), and for a background one its
    flag and run; in KV, a large one is its owner and a :class:`LargeRef` only."""

    owner: str
    response: dict[str, Any]
    input_items: list[Any]
    messages: list[dict[str, Any]]
    background: bool
    run: RunState
    large: LargeRef
