"""``/v1/files`` over HTTP (OpenAI's Files API): upload, list, get, download, delete. The
store is :mod:`jobs.files`.

Uploads are ``multipart/form-data`` with the parts ``file`` and ``purpose``, as the openai
SDKs send them. Users upload ``purpose: batch`` files (a batch's input); batches write their
output and error files as ``batch_output`` (jobs/batch_runner.py).
"""

from __future__ import annotations

import email.parser
import email.policy
from typing import Any

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
    read_bytes,
    send_error,
    send_json,
)
from jobs.files import PURPOSES, FileStore
from jobs.inprocess import PRINCIPAL
from services import logging as tlog
from services.config import FilesSettings

PREFIX = "/v1/files"
log = tlog.get("files")


def owner_of(owner_fn: Any, scope: Scope) -> str:
    """Who a request acts for: the key a trusted caller in this process runs it for
    (``scope[PRINCIPAL]``), else the id of the caller's own API key (``owner_fn``)."""
    principal = scope.get(PRINCIPAL)
    if isinstance(principal, str):
        return principal
    return str(owner_fn(api_key(scope).get(H.API_KEY)))


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
            f"purpose: {purpose!r} is not served; upload batch input as 'batch', files for "
            "requests to name by id as 'user_data' (or 'vision' for images)",
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
            await send_json(send, 200, await self.store.upload(owner, filename, purpose, data))
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
