"""Issue: idle suspend and transparent wake (the test server sweeps every second)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import PalServer, assert_runs_no_guest
from tests.leaks import vm_dir_of

pytestmark = pytest.mark.vm

REASON = "auto-suspended (idle timeout)"


# A hang guard, not a speed bound: a loaded 2-core machine may take long to suspend.
DEADLINE_S = 300


def wait_state(api: httpx.Client, vm: str, state: str) -> float:
    """Poll until ``vm`` is in ``state``; the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < DEADLINE_S:
        if api.get(f"/v1/runtime/vms/{vm}").json()["state"] == state:
            return time.monotonic() - t0
        time.sleep(0.25)
    raise AssertionError(f"{vm} never became {state}: {api.get(f'/v1/runtime/vms/{vm}').json()}")


def test_idle_vm_suspends_shows_paused_and_wakes_on_exec(pal_server: PalServer, api: httpx.Client) -> None:
    vm = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 5}).json()["vmId"]
    try:
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "keep.txt"}, content="kept\n")
        took = wait_state(api, vm, "paused")
        assert took >= 4, "not suspended before its timeout"  # 5 s after the file write
        got = api.get(f"/v1/runtime/vms/{vm}").json()
        assert got["reason"] == REASON and got["snapshotId"]
        listed = {v["vmId"]: v for v in api.get("/v1/runtime/vms").json()["vms"]}
        assert listed[vm]["state"] == "paused" and listed[vm]["reason"] == REASON
        assert_runs_no_guest(vm_dir_of(pal_server.data_dir, vm))
        # the next request wakes it transparently, same vmId, files intact
        r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "cat", "argv": ["keep.txt"]})
        assert r.status_code == 200, r.text
        assert {**r.json(), "processId": 0} == {
            "exitCode": 0,
            "stdout": "kept\n",
            "stderr": "",
            "processId": 0,
        }
        assert api.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"
        events = api.get(f"/v1/runtime/vms/{vm}/events").json()["events"]
        assert any(e["kind"] == "auto_resume" for e in events), events
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_file_read_wakes_an_idle_vm(api: httpx.Client) -> None:
    vm = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 3}).json()["vmId"]
    try:
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "a.txt"}, content="A")
        wait_state(api, vm, "paused")
        r = api.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "a.txt"})
        assert r.status_code == 200 and r.text == "A"
        assert api.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_vm_with_exec_in_flight_is_never_idle(
    pal_server: PalServer, tenant_key: str, api: httpx.Client
) -> None:
    busy = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 3}).json()["vmId"]
    result: dict = {}
    # Runs until the test releases it, however long the machine takes.
    wait = ["-c", "while [ ! -e release ]; do sleep 0.2; done; echo released"]

    def long_exec() -> None:
        with pal_server.client(tenant_key) as c:
            r = c.post(f"/v1/runtime/vms/{busy}/exec", json={"command": "/bin/sh", "argv": wait})
            result["status"] = r.status_code
            result["body"] = r.json()

    t = threading.Thread(target=long_exec)
    t.start()
    idle = None
    try:
        # A VM with the same timeout, scheduled later and left alone: once the sweeper has
        # suspended it, it has also judged the busy VM, whose timeout expired earlier.
        idle = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 3}).json()["vmId"]
        wait_state(api, idle, "paused")
        assert api.get(f"/v1/runtime/vms/{busy}").json()["state"] == "running"
        release = api.put(f"/v1/runtime/vms/{busy}/files/content", params={"path": "release"}, content=b"")
        assert release.status_code == 200, release.text
        t.join(DEADLINE_S)
        body = result["body"]
        assert result["status"] == 200 and isinstance(body.pop("processId"), int), result
        assert body == {"exitCode": 0, "stdout": "released\n", "stderr": ""}
    finally:
        if t.is_alive():
            api.delete(f"/v1/runtime/vms/{busy}")  # ends the exec
        t.join(DEADLINE_S)
        for vm in (busy, idle):
            if vm:
                api.delete(f"/v1/runtime/vms/{vm}")


def test_operator_paused_vm_with_idle_timeout_is_not_auto_resumed(api: httpx.Client) -> None:
    vm = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 60}).json()["vmId"]
    try:
        assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
        r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "true"})
        assert r.status_code == 409
        assert api.get(f"/v1/runtime/vms/{vm}").json()["state"] == "paused"
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_idle_wake_over_quota_is_402(pal_server: PalServer) -> None:
    key = pal_server.tenant("it-idle-quota", max_vms=1)
    with pal_server.client(key) as c:
        a = c.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 3}).json()["vmId"]
        wait_state(c, a, "paused")
        b = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
        r = c.post(f"/v1/runtime/vms/{a}/exec", json={"command": "true"})
        assert r.status_code == 402
        c.delete(f"/v1/runtime/vms/{b}")
        c.delete(f"/v1/runtime/vms/{a}")
