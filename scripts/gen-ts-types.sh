#!/usr/bin/env bash
# Regenerate the TypeScript SDK's API types after a change to the REST API:
# sdk/typescript/openapi.json (the server's OpenAPI document) and src/openapi.ts from it.
# tests/unit/test_openapi_ts.py fails until both match the code.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
.venv/bin/python -m pal.api.openapi >sdk/typescript/openapi.json
cd sdk/typescript
[[ -d node_modules ]] || npm ci --no-audit --no-fund
npm run -s gen:types
echo "regenerated sdk/typescript/openapi.json and src/openapi.ts"
