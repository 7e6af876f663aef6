"""The file store (what OpenAI's Files API serves), files in a JetStream object store.

A file is an object named by its id in the bucket ``tokenbus_files``; its OpenAI file object
(``filename``, ``purpose``, ``created_at``, ``expires_at``) and its owner, the id of the API
key that uploaded it (empty where the pipeline checks no keys), are the object's
description. A read, a download or a delete by another key is answered exactly as for an id
that does not exist (404). The bucket has a TTL (``files.ttl_s``) and a size bound
(``files.max_bytes``); one upload is bounded by ``files.max_file_bytes``, and what one key's
uploads hold at once by ``files.max_bytes_per_key`` (:meth:`FileStore.upload`). Every bridge
process shares the bucket, so a file uploaded through one is read through any.

Users upload ``purpose: batch`` files (a batch's input, through :mod:`gateway.files_api` or
ingress) and ``user_data`` or ``vision`` files (that a request names by ``file_id``:
:mod:`gateway.file_inputs`); batches write their output and error files as
``batch_output``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, cast

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from bus_schemas import errors as E
from jobs.job_records import FileObject, FileRecord
from services import buckets
from services import logging as tlog
from services.config import FilesSettings

BUCKET = "tokenbus_files"
# What users may upload: batch input, and files for requests to name by id (OpenAI's
# purposes for them; gateway/file_inputs.py).
PURPOSES = ("batch", "user_data", "vision")
OUTPUT_PURPOSE = "batch_output"
log = tlog.get("files")


def not_found(file_id: str) -> E.NotFound:
    return E.NotFound(f"no file with id {file_id!r}", param="file_id")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


class FileStore:
    """Files in the object store; ``owner`` is a key id (``""``: an open deployment)."""

    def __init__(self, nc: NATS, settings: FilesSettings) -> None:
        self.nc = nc
        self.settings = settings
        self.obs: ObjectStore | None = None

    async def open(self) -> FileStore:
        # Opened once, at start or at a first request: a JetStream that does not answer is
        # said at once (stall_s=0), and the caller serves without files or answers 503.
        self.obs = await buckets.open_objects(
            self.nc.jetstream(),
            BUCKET,
            ttl=self.settings.ttl_s,
            max_bytes=self.settings.max_bytes,
            stall_s=0,
        )
        return self

    def _store(self) -> ObjectStore:
        if self.obs is None:
            raise E.ServiceUnavailable("the file store (JetStream) is not open; retry")
        return self.obs

    async def put(
        self,
        owner: str,
        filename: str,
        purpose: str,
        data: bytes,
        file_id: str | None = None,
    ) -> FileObject:
        """Store ``data``; its file object. ``file_id``: a name chosen by the caller (a
        batch's output file, written again to the same id if its writer is retried)."""
        now = int(time.time())
        fid = file_id or new_file_id()
        obj: FileObject = {
            "id": fid,
            "object": "file",
            "bytes": len(data),
            "created_at": now,
            "expires_at": now + int(self.settings.ttl_s),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
        }
        rec: FileRecord = {"owner": owner, "file": obj}
        meta = api.ObjectMeta(name=fid, description=json.dumps(rec))
        try:
            await self._store().put(fid, data, meta=meta)
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise _store_error(exc) from None
        return obj

    async def upload(self, owner: str, filename: str, purpose: str, data: bytes) -> FileObject:
        """A user's upload: :meth:`put` once the key's files and ``data`` fit its share of
        the store (``files.max_bytes_per_key``; 429 ``insufficient_quota`` otherwise). An
        open deployment's uploads (owner ``""``) share the store's own bound only."""
        if owner:
            held = sum(int(f.get("bytes") or 0) for f in await self.list(owner))
            most = self.settings.max_bytes_per_key
            if held + len(data) > most:
                raise E.InsufficientQuota(
                    f"this key's files hold {held} bytes of the {most} it may keep; delete "
                    f"files (DELETE /v1/files/{{id}}) before uploading {len(data)} more"
                )
        return await self.put(owner, filename, purpose, data)

    async def _info(self, file_id: str, owner: str) -> FileRecord:
        try:
            info = await self._store().get_info(file_id)
        except (ObjectNotFoundError, NotFoundError, BadRequestError):
            raise not_found(file_id) from None
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise _store_error(exc) from None
        rec = _record(info)
        if rec is None or rec["owner"] != owner or info.deleted:
            raise not_found(file_id)
        return rec

    async def get(self, file_id: str, owner: str) -> FileObject:
        """The file object of ``owner``'s file (404 otherwise)."""
        return (await self._info(file_id, owner))["file"].copy()

    async def content(self, file_id: str, owner: str) -> bytes:
        """The bytes of ``owner``'s file (404 otherwise)."""
        await self._info(file_id, owner)
        try:
            res = await buckets.get_object(self._store(), file_id)
        except (ObjectNotFoundError, NotFoundError):
            raise not_found(file_id) from None
        except Exception as exc:
            raise _store_error(exc) from None
        return bytes(res.data or b"")

    async def delete(self, file_id: str, owner: str) -> None:
        await self._info(file_id, owner)
        try:
            await self._store().delete(file_id)
        except (ObjectNotFoundError, NotFoundError):
            raise not_found(file_id) from None
        except Exception as exc:
            raise _store_error(exc) from None

    async def list(self, owner: str, purpose: str | None = None) -> list[FileObject]:
        """``owner``'s files, newest first."""
        try:
            infos = await self._store().list()
        except NotFoundError:  # an empty bucket
            return []
        except Exception as exc:
            raise _store_error(exc) from None
        out: list[FileObject] = []
        for info in infos:
            rec = _record(info)
            if rec is None or info.deleted or rec["owner"] != owner:
                continue
            if purpose is not None and rec["file"].get("purpose") != purpose:
                continue
            out.append(rec["file"].copy())
        out.sort(key=lambda f: (f["created_at"], f["id"]), reverse=True)
        return out


def _record(info: Any) -> FileRecord | None:
    """The file record an object's description holds (None: not one)."""
    try:
        rec = json.loads(info.description or "")
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("file"), dict):
        return None
    return cast(FileRecord, rec)


def _store_error(exc: BaseException) -> E.TokenbusError:
    text = str(exc).lower()
    if "maximum bytes" in text or "insufficient resources" in text or "storage" in text:
        return E.StorageFull("the file store is full; delete files or raise files.max_bytes")
    log.warning("file_store_unavailable", error=repr(exc))
    return E.ServiceUnavailable("the file store (JetStream) did not answer; retry")
