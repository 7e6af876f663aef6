"""Files as inputs: a content part that names a file of the key's own ``/v1/files`` by
``file_id`` is sent to the engine with the file's bytes in it.

* chat: a ``file`` part's ``file.file_id`` becomes ``file.file_data`` (a ``data:`` URL, with
  the file's name as ``filename`` where the part has none);
* Responses: an ``input_file`` part's ``file_id`` becomes ``file_data`` the same way, and an
  ``input_image`` part's ``file_id`` becomes its ``image_url`` (a ``data:`` URL of the image);
* Anthropic's Messages API: an ``image`` or ``document`` block whose ``source`` is
  ``{"type": "file", "file_id": ...}`` becomes a ``base64`` source.

A file of another key is answered as one that does not exist (404, as ``GET
/v1/files/{id}`` answers it). A ``file_url`` (Responses ``input_file``) is not fetched by the
bridge: it is carried to the engine, which fetches it or refuses it. The inlined request must
still fit the bridge's body bound (``bridge.max_body_bytes``): a file that makes it larger is
a 400 that says so. Where the Files API is not served (no JetStream), a ``file_id`` is a 400
that says that.
"""

from __future__ import annotations

import base64
import mimetypes
import re
from collections.abc import Callable
from typing import Any

from bus_schemas import errors as E
from jobs.files import FileStore

# Who the request acts for (the id of its key), asked only when a file is named.
Owner = Callable[[], str]

# What a file's id can look like (jobs.files.new_file_id: ``file-`` and hex digits).
_FILE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

# Leading bytes of the image formats engines read, for a file whose name says nothing.
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"%PDF-", "application/pdf"),
)


def media_type(name: str, data: bytes) -> str:
    """A file's media type: by its first bytes (images, PDF), else by its name."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


class FileInputs:
    """Puts the bytes of the files a request names by ``file_id`` into it (the module's
    docstring). ``store`` None: the Files API is not served here. Each method takes the
    request's body (changed in place) and who it acts for."""

    def __init__(self, store: FileStore | None, max_bytes: int) -> None:
        self.store = store
        self.max_bytes = max_bytes

    async def _data_url(
        self, file_id: Any, owner: Owner, path: str, image: bool
    ) -> tuple[str, str]:
        """(``data:`` URL, filename) of the file ``file_id`` of the key ``owner()`` names."""
        if not isinstance(file_id, str):
            raise E.InvalidRequest(f"{path}: file_id must be a file's id", param=path)
        if self.store is None:
            raise E.InvalidRequest(
                f"{path}: files by id need the Files API, which this bridge does not serve "
                "(it needs JetStream); send the file's data instead",
                param=path,
            )
        who = owner()
        try:  # another key's file is one that does not exist
            if not _FILE_ID.fullmatch(file_id):  # no file is named so
                raise E.NotFound(file_id)
            info = await self.store.get(file_id, who)
            data = await self.store.content(file_id, who)
        except E.NotFound:
            raise E.NotFound(
                f"{path}: no file with id {file_id!r} among this key's files", param=path
            ) from None
        name = str(info.get("filename") or file_id)
        kind = media_type(name, data)
        if image and not kind.startswith("image/"):
            raise E.InvalidRequest(
                f"{path}: the file {file_id} is not an image ({kind}); an image part needs "
                "a PNG, JPEG, GIF or WebP file",
                param=path,
            )
        if len(data) * 4 // 3 > self.max_bytes:
            raise E.InvalidRequest(
                f"{path}: the file {file_id} ({len(data)} bytes) does not fit in a request "
                f"(bridge.max_body_bytes {self.max_bytes}); send a smaller file",
                param=path,
            )
        return f"data:{kind};base64,{base64.b64encode(data).decode()}", name

    async def _parts(
        self, parts: Any, path: str, change: Callable[[dict[str, Any], str], Any]
    ) -> None:
        """Apply ``change`` (an async rewrite of one part, or None) to each part of a
        content list."""
        if not isinstance(parts, list):
            return
        for i, part in enumerate(parts):
            if isinstance(part, dict):
                await change(part, f"{path}.{i}")

    async def chat(self, body: Any, owner: Owner) -> None:
        """A chat body's ``file`` parts by ``file_id``, in place."""
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return

        async def part(p: dict[str, Any], path: str) -> None:
            f = p.get("file")
            if p.get("type") != "file" or not isinstance(f, dict) or "file_id" not in f:
                return
            url, name = await self._data_url(f["file_id"], owner, f"{path}.file.file_id", False)
            rest = {k: v for k, v in f.items() if k != "file_id"}
            p["file"] = {**rest, "file_data": url, "filename": f.get("filename") or name}

        for i, m in enumerate(body["messages"]):
            if isinstance(m, dict):
                await self._parts(m.get("content"), f"messages.{i}.content", part)

    async def responses(self, body: Any, owner: Owner) -> None:
        """A Responses body's ``input_file`` and ``input_image`` parts by ``file_id``."""
        if not isinstance(body, dict) or not isinstance(body.get("input"), list):
            return

        async def part(p: dict[str, Any], path: str) -> None:
            kind, file_id = p.get("type"), p.get("file_id")
            if file_id is None or kind not in ("input_file", "input_image"):
                return
            image = kind == "input_image"
            url, name = await self._data_url(file_id, owner, f"{path}.file_id", image)
            del p["file_id"]
            if image:
                p["image_url"] = url
            else:
                p["file_data"] = url
                p.setdefault("filename", name)

        for i, item in enumerate(body["input"]):
            if isinstance(item, dict):
                await self._parts(item.get("content"), f"input.{i}.content", part)

    async def messages(self, body: Any, owner: Owner) -> None:
        """An Anthropic Messages body's ``image`` and ``document`` blocks with a ``file``
        source."""
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return

        async def block(b: dict[str, Any], path: str) -> None:
            src = b.get("source")
            if b.get("type") not in ("image", "document") or not isinstance(src, dict):
                return
            if src.get("type") != "file":
                return
            image = b["type"] == "image"
            url, name = await self._data_url(
                src.get("file_id"), owner, f"{path}.source.file_id", image
            )
            kind, _, data = url[len("data:") :].partition(";base64,")
            b["source"] = {"type": "base64", "media_type": kind, "data": data}
            if not image:
                b.setdefault("title", name)

        for i, m in enumerate(body["messages"]):
            if isinstance(m, dict):
                await self._parts(m.get("content"), f"messages.{i}.content", block)
