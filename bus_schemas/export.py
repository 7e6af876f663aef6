"""Write the JSON Schema of every exported message to ``bus_schemas/schemas/``.

``python -m bus_schemas.export`` after a model change; a test fails while the files differ,
so a wire change is always a visible diff.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bus_schemas.messages import EXPORTED

SCHEMA_DIR = Path(__file__).parent / "schemas"


def schemas() -> dict[str, dict[str, Any]]:
    """Every exported model's JSON Schema, by model name."""
    return {name: model.model_json_schema() for name, model in EXPORTED.items()}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main() -> None:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, schema in schemas().items():
        (SCHEMA_DIR / f"{name}.json").write_text(render(schema))
        print(f"wrote {SCHEMA_DIR / name}.json")


if __name__ == "__main__":
    main()
