#!/usr/bin/env bash
# Regenerate pal/e2b/gen/ from Pal's interface files pal/e2b/proto/*.proto: Debian's protoc
# with the pinned plugins of the dev dependencies (protoc-gen-py for the messages,
# protoc-gen-connectrpc for the Connect services), matching the pinned runtimes
# protobuf-py and connectrpc. tests/unit/test_e2b_proto.py checks the files are current.
# Usage: bash scripts/gen-e2b-proto.sh [OUT_DIR]   (default: pal/e2b/gen)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$REPO/pal/e2b/gen}"
BIN="$REPO/.venv/bin"
mkdir -p "$OUT"
protoc \
  --proto_path "$REPO/pal/e2b/proto" \
  --plugin=protoc-gen-py="$BIN/protoc-gen-py" \
  --plugin=protoc-gen-connectrpc="$BIN/protoc-gen-connectrpc" \
  --py_out "$OUT" \
  --connectrpc_out "$OUT" \
  "$REPO/pal/e2b/proto/process.proto" "$REPO/pal/e2b/proto/filesystem.proto"
