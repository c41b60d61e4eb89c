"""Kill -9 at each new step of a pre-started restore (pal/manager/prestart.py): after the
restart the restoring VM's state is true (a resume: paused, its snapshot intact; a fork
child: failed, its source running), the QEMU it was taking is gone and never handed to
anyone else (nor kept waiting), nothing is leaked (tests/leaks.py), and a resume then
takes a newly started QEMU with the VM's data intact.

The steps: ``manager:prestart-spawned`` (a QEMU waits, its state file not written yet),
``manager:prestart-ready`` (a QEMU waits; no restore has it),
``manager:prestart-taken`` (taken by a restore; its state file still says prestarted),
``manager:prestart-filled`` (the snapshot's disk and RAM reflinked in, the VM on the
gateway) and ``manager:prestart-loaded`` (device state loaded, the guest runs, no identity
and no commit yet).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import qemu_pids_under, scratch_run_dir, start_server, stop_server
from tests.integration.test_prestart import PRESTART_ENV, assert_data, up_timings, wait_prestarted, with_data
from tests.leaks import problems, vm_slots

pytestmark = pytest.mark.vm

DEADLINE_S = 300  # a hang guard, not a speed bound

# failpoint, the operation killed by it -> the states its VM may truthfully be in after the restart
CASES = {
    ("manager:prestart-taken", "resume"): {"paused"},
    ("manager:prestart-filled", "resume"): {"paused"},
    ("manager:prestart-loaded", "resume"): {"paused"},
    ("manager:prestart-taken", "fork"): {"failed"},  # the child; its source runs on
}


@pytest.fixture
def run_dir(warm_template: None) -> Iterator[Path]:
    with scratch_run_dir("prekill") as d:
        yield d


def settled_state(c: httpx.Client, vm: str) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = c.get(f"/v1/runtime/vms/{vm}").json()["state"]
        if got not in ("pending", "spawning", "resuming"):
            return str(got)
        time.sleep(0.3)
    raise AssertionError(f"VM {vm} never settled")


@pytest.mark.parametrize(("failpoint", "op"), sorted(CASES), ids=lambda v: str(v))
def test_a_take_killed_at_each_step_hands_the_qemu_to_no_one_else_and_leaks_nothing(
    run_dir: Path, failpoint: str, op: str
) -> None:
    server = start_server(run_dir, {**PRESTART_ENV, "PAL_FAILPOINT": failpoint})
    try:
        key = server.tenant("prestart-kill", max_vms=4)
        with server.client(key, timeout=DEADLINE_S) as c:
            vm = with_data(c)
            if op == "resume":
                assert c.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
            waiting = wait_prestarted(server, 2)
            with contextlib.suppress(httpx.HTTPError):
                if op == "resume":
                    c.post(f"/v1/runtime/vms/{vm}/resume")
                else:
                    c.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 1})
        server.proc.wait(DEADLINE_S)
        assert server.proc.returncode == -9, f"the failpoint killed the server:\n{server.log_tail()}"
    finally:
        stop_server(server)

    server = start_server(run_dir, PRESTART_ENV)
    try:
        with server.client(key, timeout=DEADLINE_S) as c:
            # Every QEMU that waited (the one being taken too) is gone with its slot:
            # a restart adopts no pre-started QEMU, and starts new ones.
            fresh = wait_prestarted(server, 2, not_among=set(waiting))
            for slot in waiting:
                assert not (run_dir / "vms" / slot).exists() and not qemu_pids_under(run_dir / "vms" / slot)
            vms = {v["vmId"]: v for v in c.get("/v1/runtime/vms").json()["vms"]}
            target = vm if op == "resume" else next(v for v in vms if v != vm)
            assert settled_state(c, target) in CASES[(failpoint, op)]
            if op == "fork":
                assert settled_state(c, vm) == "running"
            assert problems(run_dir) == []
            # The VM is used as its state says it can be: resumed, into a new pre-started QEMU.
            taken = set(waiting)
            if op == "resume":
                assert c.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
                assert vm_slots(run_dir)[vm] in fresh and up_timings(c, vm).get("prestarted") == 1
                taken.add(vm_slots(run_dir)[vm])
            assert_data(c, vm)
            for v in vms:
                c.delete(f"/v1/runtime/vms/{v}")
            wait_prestarted(server, 2, not_among=taken)
            assert problems(run_dir) == []
    finally:
        stop_server(server)


@pytest.mark.parametrize("failpoint", ["manager:prestart-spawned", "manager:prestart-ready"])
def test_a_node_killed_while_qemus_wait_kills_them_at_restart_and_starts_new_ones(
    run_dir: Path, failpoint: str
) -> None:
    try:
        server = start_server(run_dir, {**PRESTART_ENV, "PAL_FAILPOINT": failpoint})
    except RuntimeError as exc:  # killed before it answered its health check
        assert "exited with -9" in str(exc), exc
    else:
        try:
            server.proc.wait(DEADLINE_S)
            assert server.proc.returncode == -9, f"the failpoint killed the server:\n{server.log_tail()}"
        finally:
            stop_server(server)
    left = {d.name for d in (run_dir / "vms").iterdir()}
    assert left and qemu_pids_under(run_dir / "vms"), "a QEMU waited when the node died"

    server = start_server(run_dir, PRESTART_ENV)
    try:
        key = server.tenant("prestart-ready-kill", max_vms=2)
        wait_prestarted(server, 2, not_among=left)
        assert not left & {d.name for d in (run_dir / "vms").iterdir()}
        assert problems(run_dir) == []
        with server.client(key, timeout=DEADLINE_S) as c:
            vm = with_data(c)
            assert c.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
            assert c.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
            assert up_timings(c, vm).get("prestarted") == 1
            assert_data(c, vm)
            c.delete(f"/v1/runtime/vms/{vm}")
    finally:
        stop_server(server)
