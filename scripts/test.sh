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
.venv/bin/ruff check pal pal_tools tests
.venv/bin/ruff format --check pal pal_tools tests

# Types: mypy on the whole package, and --strict on the seams between the processes (the
# API, the scheduler, the wire contract, the node's RPC layer: its server and socket, the
# guest relay, and the handler table NodeRuntime binds): no Any crosses them.
echo "==> mypy"
.venv/bin/mypy pal pal_tools
.venv/bin/mypy --strict pal/api pal/scheduler pal/wire \
  pal/manager/rpc.py pal/manager/rpc_socket.py pal/manager/guest_relay.py pal/manager/runtime.py

# Before any VM test: one real VM under the settings the suite uses (this environment's
# PAL_*). A host where no VM can start stops the run here, within two minutes, with the
# reason and `pal doctor`'s verdict (tests/preflight.py), not test by test.
vm_tests=1 # the whole suite, or a run naming a test path outside tests/unit
for arg in "$@"; do
  [[ "$arg" == tests/* && "$arg" != tests/unit* ]] && { vm_tests=1; break; }
  [[ "$arg" == tests/unit* ]] && vm_tests=0
done
if ((vm_tests)); then
  echo "==> preflight: one VM under the suite's settings"
  .venv/bin/python -m tests.preflight
fi

echo "==> pytest"
if [[ $# -gt 0 ]]; then
  exec .venv/bin/pytest -q "$@"
fi
# The tests marked `alone` run first, alone: they bound what holds on a quiet host (what a
# flooding guest gets, the guest clock to milliseconds). The other VM tests (adversarial,
# e2e, integration) then run in two xdist workers, a test file whole in one worker, each
# worker with its own image and template cache (tests/conftest.py): one worker's QEMUs use
# the CPU the other's leave idle while they wait on guests, servers and browsers. The unit
# tests (pure Python, no VMs) run beside them at a low CPU priority (nice 10), for the same
# reason.
rc=0
VM_TESTS=(tests/adversarial tests/e2b tests/e2e tests/integration)
.venv/bin/pytest -q --durations=5 -m alone "${VM_TESTS[@]}" || rc=$?
UNIT_LOG="$(mktemp)"
nice -n 10 .venv/bin/pytest -q -p no:cacheprovider tests/unit >"$UNIT_LOG" 2>&1 &
UNIT_PID=$!
.venv/bin/pytest -q --durations=25 -n 2 --dist loadfile -m "not alone" "${VM_TESTS[@]}" || rc=$?
unit_rc=0
wait "$UNIT_PID" || unit_rc=$?
echo "==> unit tests (run beside the above)"
cat "$UNIT_LOG"
rm -f "$UNIT_LOG"
if [[ $rc -ne 0 || $unit_rc -ne 0 ]]; then
  echo "FAILED: VM tests exit $rc, unit tests exit $unit_rc"
  exit 1
fi
