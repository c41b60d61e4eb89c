"""The REST API's OpenAPI document without a running server (`python -m pal.api.openapi`).

The TypeScript SDK's types are generated from it (`scripts/gen-ts-types.sh`), and a test
checks the committed copy (sdk/typescript/openapi.json) against it, so the SDK cannot
drift from the API.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pal.config import Settings

from .app import create_app


def document() -> dict[str, Any]:
    # Routes only keep references to these; building the schema calls none of them.
    return create_app(scheduler=None, store=None, settings=Settings()).openapi()


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    sys.stdout.write(dumps(document()))
