"""What the runners, background responses and batch creation need of the stores: each a
small ``Protocol``, so a caller depends on the operations it uses, not on how JetStream
holds them (:class:`jobs.batches.BatchStore`, :class:`jobs.files.FileStore` and
:class:`jobs.response_store.ResponseStore` are the stores that serve them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from nats.js.kv import KeyValue

from jobs.job_records import BatchRecord, FileObject, ResponseRecord, ResultLine
from services.config import BatchSettings


class WorkQueue(Protocol):
    """The batch work stream: what queues work on it."""

    settings: BatchSettings

    async def publish(
        self, batch_id: str, what: str, body: Mapping[str, object], msg_id: str
    ) -> None:
        """Queue ``body`` as ``what`` work of ``batch_id`` (``msg_id``: a repeat is a no-op)."""
        ...


class BatchStorage(WorkQueue, Protocol):
    """Batch records (changed by compare-and-set), line results written once, the work
    stream: what creates, runs and finishes batches."""

    async def create(self, rec: BatchRecord) -> None:
        """Keep a new batch's record."""
        ...

    async def load(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        """The batch's record and its revision; None when there is none."""
        ...

    async def update(
        self, batch_id: str, change: Callable[[BatchRecord], bool]
    ) -> BatchRecord | None:
        """Apply ``change`` (False: none) until it holds; the record after it."""
        ...

    async def all(self) -> list[BatchRecord]:
        """Every batch's record."""
        ...

    async def open_ids(self) -> list[str]:
        """Ids of the batches not finished."""
        ...

    async def closed(self, batch_id: str) -> None:
        """``batch_id`` finished: out of the open list."""
        ...

    async def work_object(self, name: str) -> bytes | None:
        """A work message's body kept aside (too large for one message); None: gone."""
        ...

    async def drop_work_object(self, name: str) -> None:
        """Delete a work message's body kept aside, once its work is acknowledged."""
        ...

    async def record_result(self, batch_id: str, n: int, line: Mapping[str, object]) -> bool:
        """Write line ``n``'s answer once; False when it has one already."""
        ...

    async def answered(self, batch_id: str, n: int) -> bool:
        """Whether line ``n`` has its answer written."""
        ...

    async def collect(self, batch_id: str, total: int) -> list[ResultLine]:
        """The answers written of lines ``0..total-1``."""
        ...

    async def remaining(self, batch_id: str) -> int:
        """Work messages of the batch still in the stream."""
        ...


class FileStorage(Protocol):
    """Files by owner: what batches read their input from and write their answers to."""

    async def get(self, file_id: str, owner: str) -> FileObject:
        """The file object of ``owner``'s file (404 otherwise)."""
        ...

    async def content(self, file_id: str, owner: str) -> bytes:
        """The bytes of ``owner``'s file (404 otherwise)."""
        ...

    async def put(
        self, owner: str, filename: str, purpose: str, data: bytes, file_id: str | None = None
    ) -> FileObject:
        """Store ``data`` (under ``file_id`` when given); its file object."""
        ...


class ResponseStorage(Protocol):
    """Stored responses by owner: what background responses read and write."""

    async def opened(self) -> KeyValue:
        """The KV bucket (for a compare-and-set of a record)."""
        ...

    async def get(self, response_id: str, owner: str) -> ResponseRecord:
        """The record of ``response_id`` if ``owner`` made it; else 404."""
        ...

    async def put(self, response_id: str, record: Mapping[str, object]) -> bool:
        """Keep a new record; False when it could not be kept."""
        ...

    async def replace(self, response_id: str, record: Mapping[str, object]) -> bool:
        """Write ``record`` over the one kept; False when it could not be written."""
        ...
