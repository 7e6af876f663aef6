"""The Files API (``/v1/files``), its files in a JetStream object store.

A file is an object named by its id in the bucket ``tokenbus_files``; its OpenAI file object
(``filename``, ``purpose``, ``created_at``, ``expires_at``) and its owner, the id of the API
key that uploaded it (empty where the pipeline checks no keys), are the object's
description. A read, a download or a delete by another key is answered exactly as for an id
that does not exist (404). The bucket has a TTL (``files.ttl_s``) and a size bound
(``files.max_bytes``); one upload is bounded by ``files.max_file_bytes``. Every bridge
process shares the bucket, so a file uploaded through one is read through any.

Uploads are ``multipart/form-data`` with the parts ``file`` and ``purpose``, as the openai
SDKs send them. Users upload ``purpose: batch`` files (a batch's input); batches write their
output and error files as ``batch_output`` (gateway/batches.py).
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import time
import uuid
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from bus_schemas import errors as E
from bus_schemas import headers as H
from gateway.asgi import (
    Receive,
    Scope,
    Send,
    api_key,
    header,
    list_page,
    query_of,
    send_error,
    send_json,
)
from gateway.openai_api import PRINCIPAL, read_bytes
from services import logging as tlog
from services.config import FilesSettings, kv_replicas

BUCKET = "tokenbus_files"
PREFIX = "/v1/files"
PURPOSES = ("batch",)  # what users may upload
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
        js = self.nc.jetstream()
        try:
            self.obs = await js.object_store(BUCKET)
        except (BucketNotFoundError, NotFoundError):
            try:
                self.obs = await js.create_object_store(
                    BUCKET,
                    config=api.ObjectStoreConfig(
                        bucket=BUCKET,
                        ttl=self.settings.ttl_s,
                        max_bytes=self.settings.max_bytes,
                        replicas=kv_replicas(),
                    ),
                )
            except BadRequestError:  # another process made it meanwhile
                self.obs = await js.object_store(BUCKET)
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
    ) -> dict[str, Any]:
        """Store ``data``; its file object. ``file_id``: a name chosen by the caller (a
        batch's output file, written again to the same id if its writer is retried)."""
        now = int(time.time())
        fid = file_id or new_file_id()
        obj = {
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
        meta = api.ObjectMeta(name=fid, description=json.dumps({"owner": owner, "file": obj}))
        try:
            await self._store().put(fid, data, meta=meta)
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise _store_error(exc) from None
        return obj

    async def _info(self, file_id: str, owner: str) -> dict[str, Any]:
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

    async def get(self, file_id: str, owner: str) -> dict[str, Any]:
        """The file object of ``owner``'s file (404 otherwise)."""
        return dict((await self._info(file_id, owner))["file"])

    async def content(self, file_id: str, owner: str) -> bytes:
        """The bytes of ``owner``'s file (404 otherwise)."""
        await self._info(file_id, owner)
        try:
            res = await self._store().get(file_id)
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

    async def list(self, owner: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """``owner``'s files, newest first."""
        try:
            infos = await self._store().list()
        except NotFoundError:  # an empty bucket
            return []
        except Exception as exc:
            raise _store_error(exc) from None
        out = []
        for info in infos:
            rec = _record(info)
            if rec is None or info.deleted or rec["owner"] != owner:
                continue
            if purpose is not None and rec["file"].get("purpose") != purpose:
                continue
            out.append(dict(rec["file"]))
        out.sort(key=lambda f: (f["created_at"], f["id"]), reverse=True)
        return out


def owner_of(owner_fn: Any, scope: Scope) -> str:
    """Who a request acts for: the key a trusted caller in this process runs it for
    (``scope[PRINCIPAL]``), else the id of the caller's own API key (``owner_fn``)."""
    principal = scope.get(PRINCIPAL)
    if isinstance(principal, str):
        return principal
    return str(owner_fn(api_key(scope).get(H.API_KEY)))


def _record(info: Any) -> dict[str, Any] | None:
    try:
        rec = json.loads(info.description or "")
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("file"), dict):
        return None
    return rec


def _store_error(exc: BaseException) -> E.TokenbusError:
    text = str(exc).lower()
    if "maximum bytes" in text or "insufficient resources" in text or "storage" in text:
        return E.StorageFull("the file store is full; delete files or raise files.max_bytes")
    log.warning("file_store_unavailable", error=repr(exc))
    return E.ServiceUnavailable("the file store (JetStream) did not answer; retry")


def parse_upload(content_type: str, body: bytes) -> tuple[str, str, bytes]:
    """(filename, purpose, data) of a ``multipart/form-data`` upload; 400 when a part is
    missing or the body is not multipart."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise E.InvalidRequest(
            "upload a file as multipart/form-data with the parts 'file' and 'purpose'",
            param="file",
        )
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    filename, purpose, data = "", None, None
    for part in msg.iter_parts() if msg.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if name == "file":
            filename = str(part.get_filename() or "upload.jsonl")
            data = bytes(payload or b"")
        elif name == "purpose":
            purpose = bytes(payload or b"").decode("utf-8", "replace").strip()
    if data is None:
        raise E.InvalidRequest("the upload has no 'file' part", param="file")
    if not purpose:
        raise E.InvalidRequest("the upload has no 'purpose' part", param="purpose")
    if purpose not in PURPOSES:
        raise E.InvalidRequest(
            f"purpose: {purpose!r} is not served; upload batch input as 'batch'",
            param="purpose",
        )
    return filename[:255], purpose, data


class FilesAPI:
    """``/v1/files`` on an ASGI route table (``mount``); ``owner`` maps the caller's API
    key to its id (401 for a key that is not valid)."""

    def __init__(self, store: FileStore, owner: Any, settings: FilesSettings) -> None:
        self.store = store
        self.owner = owner
        self.settings = settings

    def mount(self, app: Any) -> None:
        app.add_route("POST", PREFIX, self.upload)
        app.add_route("GET", PREFIX, self.listing)
        app.add_prefix(PREFIX, self.by_id)

    def _owner(self, scope: Scope) -> str:
        return owner_of(self.owner, scope)

    async def upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            owner = self._owner(scope)
            body = await read_bytes(scope, receive, self.settings.max_file_bytes, 300.0)
            filename, purpose, data = parse_upload(header(scope, b"content-type") or "", body)
            await send_json(send, 200, await self.store.put(owner, filename, purpose, data))
        except E.TokenbusError as exc:
            await send_error(send, exc)

    async def listing(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            owner = self._owner(scope)
            query = query_of(scope)
            files = await self.store.list(owner, query.get("purpose"))
            await send_json(send, 200, list_page(files, query, default=10_000, most=10_000))
        except E.TokenbusError as exc:
            await send_error(send, exc)

    async def by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET``/``DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content``."""
        method = scope["method"]
        path = scope["path"].rstrip("/")
        parts = path[len(PREFIX) + 1 :].split("/")
        try:
            owner = self._owner(scope)
            if len(parts) == 1 and parts[0] and method == "GET":
                await send_json(send, 200, await self.store.get(parts[0], owner))
            elif len(parts) == 1 and parts[0] and method == "DELETE":
                await self.store.delete(parts[0], owner)
                await send_json(send, 200, {"id": parts[0], "object": "file", "deleted": True})
            elif len(parts) == 2 and parts[1] == "content" and method == "GET":
                data = await self.store.content(parts[0], owner)
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"application/octet-stream"),
                            (b"content-length", str(len(data)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": data})
            else:
                raise E.NotFound(f"no route for {method} {path}")
        except E.TokenbusError as exc:
            await send_error(send, exc)
