"""The TypeScript SDK cannot drift from the API: its committed copy of the OpenAPI document
(from which its types are generated) must equal the server's. After an API change run
`bash scripts/gen-ts-types.sh` and commit both files."""

from __future__ import annotations

import json
from pathlib import Path

from pal.api.openapi import document

COMMITTED = Path(__file__).resolve().parents[2] / "sdk" / "typescript" / "openapi.json"


def test_the_sdk_openapi_copy_matches_the_server() -> None:
    committed = json.loads(COMMITTED.read_text())
    assert committed == document(), (
        "the REST API changed: run `bash scripts/gen-ts-types.sh` to regenerate the TypeScript "
        "SDK's types (sdk/typescript/openapi.json, src/openapi.ts), fix the SDK if it no longer "
        "compiles, and commit them"
    )
