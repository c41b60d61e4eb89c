"""Issue 25 item 3: a VM's metadata (bounded, shown, filtered on, inherited by forks) and
its lifetime (it ends a busy VM, paused or deleted, with an audit event; extended live;
its deadline survives a restart). The test server sweeps every second."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pal.spec import MAX_METADATA_KEYS
from tests.conftest import PalServer, scratch_run_dir, start_server, stop_server

pytestmark = pytest.mark.vm

DEADLINE_S = 300  # a hang guard, not a speed bound: a loaded 2-core host is slow


def poll(what: str, fn: Any) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < DEADLINE_S:
        got = fn()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"never: {what}")


def state_of(api: httpx.Client, vm: str) -> str:
    return str(api.get(f"/v1/runtime/vms/{vm}").json()["state"])


def listed(api: httpx.Client, **meta: str) -> list[str]:
    params = {f"metadata.{k}": v for k, v in meta.items()}
    r = api.get("/v1/runtime/vms", params=params)
    assert r.status_code == 200, r.text
    return [v["vmId"] for v in r.json()["vms"]]


def lifetime_events(api: httpx.Client, vm: str) -> list[dict[str, Any]]:
    events = api.get(f"/v1/runtime/vms/{vm}/events").json()["events"]
    return [e for e in events if e["kind"] == "lifetime_ended"]


def lifetime_ended(api: httpx.Client, vm: str, final: str) -> dict[str, Any]:
    """The one ``lifetime_ended`` event, once the sweep wrote it (just after its delete or
    pause), with the VM then in ``final``."""
    poll(f"{vm}'s lifetime_ended event", lambda: lifetime_events(api, vm))
    (ended,) = lifetime_events(api, vm)
    assert state_of(api, vm) == final
    return ended


@pytest.fixture
def cleanup(api: httpx.Client) -> Iterator[list[str]]:
    vms: list[str] = []
    yield vms
    for vm in vms:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_metadata_is_shown_filtered_on_and_inherited_by_forks(api: httpx.Client, cleanup: list[str]) -> None:
    run = uuid.uuid4().hex[:12]
    a = api.post("/v1/runtime/schedule", json={"metadata": {"run": run, "team": "a"}}).json()
    b = api.post("/v1/runtime/schedule", json={"metadata": {"run": run, "team": "b/x:1"}}).json()
    cleanup += [a["vmId"], b["vmId"]]
    assert a["metadata"] == {"run": run, "team": "a"}
    assert api.get(f"/v1/runtime/vms/{b['vmId']}").json()["metadata"] == {"run": run, "team": "b/x:1"}
    assert listed(api, run=run) == [a["vmId"], b["vmId"]]
    assert listed(api, run=run, team="b/x:1") == [b["vmId"]]  # filters AND together
    assert listed(api, run=run, team="c") == []
    fork = api.post(f"/v1/runtime/vms/{a['vmId']}/fork", json={"count": 1}).json()
    child = fork["forks"][0]["vmId"]
    cleanup.append(child)
    got = api.get(f"/v1/runtime/vms/{child}").json()
    assert got["metadata"] == {"run": run, "team": "a"} and got["forkedFrom"] == a["vmId"]
    assert listed(api, run=run, team="a") == [a["vmId"], child]


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({f"k{i}": "v" for i in range(MAX_METADATA_KEYS + 1)}, f"at most {MAX_METADATA_KEYS}"),
        ({"has space": "v"}, "metadata key 'has space'"),
        ({"k": "v" * 1000}, "a string of at most"),
    ],
)
def test_metadata_out_of_bounds_is_a_400_that_says_why(
    api: httpx.Client, metadata: dict[str, str], says: str
) -> None:
    r = api.post("/v1/runtime/schedule", json={"metadata": metadata})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "INVALID_ARGUMENT" and says in r.json()["error"]["message"], r.text


def test_a_bad_metadata_filter_is_a_400(api: httpx.Client) -> None:
    r = api.get("/v1/runtime/vms", params={"metadata.bad key": "x"})
    assert r.status_code == 400 and "metadata filter" in r.json()["error"]["message"], r.text


def _busy(api: httpx.Client, vm: str) -> tuple[threading.Thread, list[str]]:
    """A streamed `sleep 600` in ``vm``; returns once the command runs. The list gets the
    stream's event names until it ends."""
    seen: list[str] = []
    started = threading.Event()

    def run() -> None:
        body = {"command": "sleep", "argv": ["600"]}
        with contextlib.suppress(httpx.HTTPError):  # the VM's end may break the connection
            with api.stream(
                "POST", f"/v1/runtime/vms/{vm}/exec", json=body, headers={"Accept": "text/event-stream"}
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        seen.append(line.split(":", 1)[1].strip())
                        started.set()
        started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(DEADLINE_S) and seen[:1] == ["process"], seen
    return t, seen


@pytest.mark.parametrize(
    ("on_end", "final", "action"), [("pause", "paused", "paused"), ("delete", "terminated", "deleted")]
)
def test_lifetime_ends_a_busy_vm_with_an_audit_event(
    api: httpx.Client, cleanup: list[str], on_end: str, final: str, action: str
) -> None:
    vm = api.post("/v1/runtime/schedule", json={"lifetimeSecs": 3600, "onLifetimeEnd": on_end}).json()
    cleanup.append(vm["vmId"])
    assert (vm["lifetimeSecs"], vm["onLifetimeEnd"]) == (3600, on_end) and vm["lifetimeEndsAt"]
    stream, seen = _busy(api, vm["vmId"])
    # extended live: 60 s more, then a lifetime from the schedule that is already over
    r = api.put(f"/v1/runtime/vms/{vm['vmId']}/lifetime", json={"extendSecs": 60})
    assert r.status_code == 200 and r.json()["lifetimeSecs"] == 3660, r.text
    assert state_of(api, vm["vmId"]) == "running"
    r = api.put(f"/v1/runtime/vms/{vm['vmId']}/lifetime", json={"lifetimeSecs": 1})
    assert r.status_code == 200 and r.json()["lifetimeSecs"] == 1, r.text
    ended = lifetime_ended(api, vm["vmId"], final)
    assert ended["details"]["action"] == action and ended["details"]["onLifetimeEnd"] == on_end, ended
    assert ended["fromState"] == "running"
    changes = api.get(f"/v1/runtime/vms/{vm['vmId']}/events").json()["events"]
    assert [e["details"]["lifetimeSecs"] for e in changes if e["kind"] == "lifetime_changed"] == [3660, 1]
    if final == "paused":
        got = api.get(f"/v1/runtime/vms/{vm['vmId']}").json()
        assert got["pausedBy"] == "operator" and got.get("lifetimeSecs") is None, got
        # an operator-style pause: a request does not wake it
        r = api.post(f"/v1/runtime/vms/{vm['vmId']}/exec", json={"command": "true"})
        assert r.status_code == 409, r.text
        # its exec stays frozen with it (as under any snapshot pause) until the VM goes
        api.delete(f"/v1/runtime/vms/{vm['vmId']}")
    # the `sleep 600` it was running ended with the VM, long before its time
    stream.join(DEADLINE_S)
    assert not stream.is_alive(), seen


def test_lifetime_of_a_terminated_vm_cannot_change(api: httpx.Client) -> None:
    vm = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    api.delete(f"/v1/runtime/vms/{vm}")
    r = api.put(f"/v1/runtime/vms/{vm}/lifetime", json={"extendSecs": 5})
    assert r.status_code == 409, r.text
    r = api.put(f"/v1/runtime/vms/{vm}/lifetime", json={"extendSecs": 5, "lifetimeSecs": 5})
    assert r.status_code == 400, r.text


def test_a_lifetime_deadline_survives_a_restart(pal_server: PalServer, tenant_key: str) -> None:
    """The first server never sweeps (its sweep interval is an hour), so the VM outlives its
    deadline there; the restarted one, which sweeps every second, deletes it: the deadline
    came from the store, not from memory. The VM was suspended by the shutdown in between,
    so this is also a paused VM whose lifetime ends with delete."""
    del pal_server, tenant_key  # the warm template exists
    with scratch_run_dir("lifetime-restart") as run_dir:
        server = start_server(run_dir, {"PAL_IDLE_SWEEP_INTERVAL": "3600"})
        try:
            key = server.tenant("lifetime", max_vms=2)
            with server.client(key) as api:
                vm = api.post("/v1/runtime/schedule", json={"lifetimeSecs": 1}).json()
                assert vm["state"] == "running", vm
                vm_id = vm["vmId"]
                poll("the deadline passed", lambda: _past(api.get(f"/v1/runtime/vms/{vm_id}").json()))
                assert state_of(api, vm_id) == "running"
        finally:
            stop_server(server)
        server = start_server(run_dir)
        try:
            with server.client(key) as api:
                ended = lifetime_ended(api, vm_id, "terminated")
                assert ended["details"]["action"] == "deleted", json.dumps(ended)
                assert ended["fromState"] == "paused"
        finally:
            stop_server(server)


def _past(vm: dict[str, Any]) -> bool:
    from datetime import UTC, datetime

    return datetime.fromisoformat(vm["lifetimeEndsAt"].replace("Z", "+00:00")) < datetime.now(UTC)
