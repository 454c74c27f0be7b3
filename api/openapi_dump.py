"""The API's OpenAPI schema as JSON, from the app itself (no server started, no database opened):
what the dashboard's types are generated from (`make api-types`, frontend/src/generated/).

    python -m api.openapi_dump [PATH]     # PATH, or stdout when none
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from api.main import create_app
from core.settings import Settings


def openapi_schema() -> dict[str, Any]:
    """The schema FastAPI serves at /openapi.json."""
    return create_app(Settings()).openapi()


def dump(schema: dict[str, Any] | None = None) -> str:
    """The schema as stable JSON text (key order as FastAPI builds it, so the same app gives the
    same text)."""
    return json.dumps(openapi_schema() if schema is None else schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m api.openapi_dump [PATH]", file=sys.stderr)
        return 2
    text = dump()
    if args:
        Path(args[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
