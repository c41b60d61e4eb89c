"""Kill -9 at each step of a claim from the warm pool (pal/manager/pool.py): after the
restart the VM's state is true, the pooled VM it was claiming is never handed to anyone
else (nor kept in the pool), nothing is leaked (tests/leaks.py), and the refilled pool
serves the next schedule.

The steps: ``manager:pool-taken`` (out of the pool, its state file still says pooled),
``manager:pool-identified`` (the tenant's identity taken, not committed) and
``manager:pool-claimed`` (committed: the state file is the tenant's, the RPC not answered).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import qemu_pids_under, scratch_run_dir, start_server, stop_server
from tests.integration.test_pool import sh, wait_pool_ready
from tests.leaks import pooled_vms, problems, vm_slots

pytestmark = pytest.mark.vm

POOL_ENV = {"PAL_POOL": "256m-1c-2048d:1"}
DEADLINE_S = 300  # a hang guard, not a speed bound

# failpoint -> the states the claiming VM may truthfully be in after the restart
CASES = {
    "manager:pool-taken": {"failed"},
    "manager:pool-identified": {"failed"},
    "manager:pool-claimed": {"running", "failed"},  # committed on the node; the row decides
}


@pytest.fixture
def run_dir(warm_template: None) -> Iterator[Path]:
    with scratch_run_dir("poolkill") as d:
        yield d


def settled_state(c: httpx.Client, vm: str) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = c.get(f"/v1/runtime/vms/{vm}").json()["state"]
        if got not in ("pending", "spawning"):
            return str(got)
        time.sleep(0.3)
    raise AssertionError(f"VM {vm} never left spawning")


@pytest.mark.parametrize("failpoint", sorted(CASES))
def test_a_claim_killed_at_each_step_hands_the_vm_to_no_one_else_and_leaks_nothing(
    run_dir: Path, failpoint: str
) -> None:
    server = start_server(run_dir, {**POOL_ENV, "PAL_FAILPOINT": failpoint})
    try:
        key = server.tenant("pool-kill", max_vms=3)
        (pool_id, slot), *_ = wait_pool_ready(server, 1).items()
        (pid,) = qemu_pids_under(run_dir / "vms" / slot)
        with server.client(key, timeout=DEADLINE_S) as c, contextlib.suppress(httpx.HTTPError):
            c.post("/v1/runtime/schedule", json={})
        server.proc.wait(DEADLINE_S)
        assert server.proc.returncode == -9, f"the failpoint killed the server:\n{server.log_tail()}"
    finally:
        stop_server(server)

    server = start_server(run_dir, POOL_ENV)
    try:
        with server.client(key, timeout=DEADLINE_S) as c:
            vms = c.get("/v1/runtime/vms").json()["vms"]
            assert len(vms) == 1, vms
            vm = vms[0]["vmId"]
            state = settled_state(c, vm)
            assert state in CASES[failpoint], state
            refilled = wait_pool_ready(server, 1, not_among={pool_id})
            # The pooled VM went to the one claim or to no one: never back into the pool.
            assert slot not in refilled.values()
            if state == "running":
                assert vm_slots(run_dir)[vm] == slot
                assert qemu_pids_under(run_dir / "vms" / slot) == [pid], "adopted, not restarted"
                assert sh(c, vm, "hostname").strip() == vm[:63]
            else:
                assert not (run_dir / "vms" / slot).exists() and not qemu_pids_under(run_dir / "vms" / slot)
            assert problems(run_dir) == []
            # The refilled pool serves the next schedule.
            r = c.post("/v1/runtime/schedule", json={})
            assert r.status_code == 200 and r.json()["bootMethod"] == "pool", r.text
            nxt = r.json()["vmId"]
            assert vm_slots(run_dir)[nxt] in refilled.values()
            assert sh(c, nxt, "hostname").strip() == nxt[:63]
            for v in (vm, nxt):
                c.delete(f"/v1/runtime/vms/{v}")
            wait_pool_ready(server, 1, not_among={pool_id, *refilled})
            assert problems(run_dir) == []
            assert set(pooled_vms(run_dir).values()).isdisjoint({slot, *refilled.values()})
    finally:
        stop_server(server)
