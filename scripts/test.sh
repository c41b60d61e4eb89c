#!/usr/bin/env bash
# Everything CI runs: set-up (packages, venv, guest image), lint, then unit, integration
# and e2e tests. The guest image is built once into PAL_TEST_DATA_DIR, outside the clone,
# so later runs reuse it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

export PAL_TEST_DATA_DIR="${PAL_TEST_DATA_DIR:-/var/lib/pal-test}"
PAL_DATA_DIR="$PAL_TEST_DATA_DIR" bash scripts/install.sh --for-tests

echo "==> ruff check"
.venv/bin/ruff check pal tests
.venv/bin/ruff format --check pal tests

echo "==> pytest"
.venv/bin/pytest -q tests "$@"
