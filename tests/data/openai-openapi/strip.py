"""Cut OpenAI's published OpenAPI document down to the operations tokenbus serves.

    git -C openai-openapi show <commit>:openapi.json > /tmp/openai-openapi.json
    python tests/data/openai-openapi/strip.py /tmp/openai-openapi.json

reads ``openapi.json`` of github.com/openai/openai-openapi at the commit README.md names
and writes ``openapi.json`` beside this script. Kept: the document's head, the
operations in :data:`SERVED` as they are (less their ``x-oaiMeta`` code samples), every
component they reference, directly or not, and the security schemes. Nothing inside a kept
schema is changed, so the cut document checks exactly what the whole one checks for these
operations. The output is deterministic (sorted keys), so running this again on the same
commit reproduces the vendored file byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# (path, method) of every operation of the document that tokenbus serves (gateway/asgi.py's
# route table: gateway/openai_api.py and gateway/responses_api.py).
SERVED = (
    ("/chat/completions", "post"),
    ("/completions", "post"),
    ("/embeddings", "post"),
    ("/models", "get"),
    ("/responses", "post"),
    ("/responses/{response_id}", "get"),
    ("/responses/{response_id}", "delete"),
    ("/responses/{response_id}/input_items", "get"),
)


def _refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                out.add(v)
            else:
                _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def strip(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with only :data:`SERVED` and what they reference."""
    paths: dict[str, Any] = {}
    for path, method in SERVED:
        item = doc["paths"][path]
        op = {k: v for k, v in item[method].items() if k != "x-oaiMeta"}
        kept = paths.setdefault(path, {k: v for k, v in item.items() if k == "parameters"})
        kept[method] = op
    todo: set[str] = set()
    _refs(paths, todo)
    seen: set[str] = set()
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        _refs(_resolve(doc, ref), todo)
    components: dict[str, dict[str, Any]] = {}
    for ref in sorted(seen):
        _, section, name = ref.removeprefix("#/").split("/", 2)
        components.setdefault(section, {})[name] = _resolve(doc, ref)
    components["securitySchemes"] = doc["components"]["securitySchemes"]
    head = {k: doc[k] for k in ("openapi", "info", "servers", "security") if k in doc}
    return {**head, "paths": paths, "components": components}


def main() -> None:
    doc = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = json.dumps(strip(doc), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    (Path(__file__).parent / "openapi.json").write_text(out, encoding="utf-8")


if __name__ == "__main__":
    main()
