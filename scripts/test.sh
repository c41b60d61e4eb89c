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
if [[ $# -gt 0 ]]; then
  exec .venv/bin/pytest -q "$@"
fi
# The adversarial tests run first, alone: some bound what a hostile guest gets out of a
# quiet host. Then the unit tests (pure Python, no VMs) run beside the other VM tests at a
# low CPU priority (nice 10): they take the cycles those tests leave idle (waits on
# guests, servers, browsers) and barely slow them.
rc=0
.venv/bin/pytest -q --durations=10 tests/adversarial || rc=$?
UNIT_LOG="$(mktemp)"
nice -n 10 .venv/bin/pytest -q -p no:cacheprovider tests/unit >"$UNIT_LOG" 2>&1 &
UNIT_PID=$!
.venv/bin/pytest -q --durations=25 tests/e2e tests/integration || rc=$?
unit_rc=0
wait "$UNIT_PID" || unit_rc=$?
echo "==> unit tests (run beside the above)"
cat "$UNIT_LOG"
rm -f "$UNIT_LOG"
if [[ $rc -ne 0 || $unit_rc -ne 0 ]]; then
  echo "FAILED: VM tests exit $rc, unit tests exit $unit_rc"
  exit 1
fi
