"""Issue: pause and resume — snapshots of memory and disk, same vmId, quota slots, 409s."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.conftest import PalServer, assert_guest_clock_is_the_hosts, assert_runs_no_guest, qemu_pids_under
from tests.leaks import data_mib, vm_dir_of

pytestmark = pytest.mark.vm

CYCLES = int(os.environ.get("PAL_TEST_PAUSE_CYCLES", "100"))

# A process that keeps its count in memory only, and reports it on request (SIGUSR1) to a
# file in tmpfs: after a restore it must still be alive, with the count it had.
COUNTER = r"""
import os, signal, time
n = 0
def report(*_):
    with open('/tmp/count', 'w') as f:
        f.write(f'{os.getpid()} {n}')
signal.signal(signal.SIGUSR1, report)
report()
while True:
    n += 1
    time.sleep(0.05)
"""


def sh(api: httpx.Client, vm: str, line: str) -> dict:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200, r.text
    return r.json()


def counter_state(api: httpx.Client, vm: str) -> tuple[int, int]:
    # the handler rewrites /tmp/count: wait for the new one (no guess at how long it takes)
    out = sh(
        api,
        vm,
        "rm -f /tmp/count && kill -USR1 $(cat /tmp/counter.pid) && "
        "while [ ! -s /tmp/count ]; do sleep 0.05; done && cat /tmp/count",
    )
    assert out["exitCode"] == 0, out
    pid, n = out["stdout"].split()
    return int(pid), int(n)


def test_pause_resume_cycles_keep_memory_processes_and_files(
    pal_server: PalServer, api: httpx.Client
) -> None:
    vm = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    try:
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "counter.py"}, content=COUNTER)
        sh(api, vm, "setsid python3 counter.py >/dev/null 2>&1 & echo $! > /tmp/counter.pid")
        # its first report means its signal handler is in place
        sh(api, vm, "for i in $(seq 300); do [ -s /tmp/count ] && break; sleep 0.1; done")
        pid0, n_prev = counter_state(api, vm)
        snapshots = set()
        for i in range(CYCLES):
            assert sh(api, vm, f"echo line-{i} >> /workspace/log.txt")["exitCode"] == 0
            r = api.post(f"/v1/runtime/vms/{vm}/pause")
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["vmId"] == vm and body["state"] == "paused" and body["snapshotId"]
            snapshots.add(body["snapshotId"])
            if i % 10 == 0:
                got = api.get(f"/v1/runtime/vms/{vm}").json()
                assert got["state"] == "paused" and got["snapshotId"] == body["snapshotId"]
            r = api.post(f"/v1/runtime/vms/{vm}/resume")
            assert r.status_code == 200, r.text
            want = {"vmId": vm, "snapshotId": body["snapshotId"], "state": "running"}
            assert r.json() == want
            if i % 10 == 0 or i == CYCLES - 1:
                pid, n = counter_state(api, vm)
                assert pid == pid0, "the background process is the same one"
                assert n > n_prev, "and it kept counting in memory"
                n_prev = n
        log = api.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "log.txt"}).text
        assert log.splitlines() == [f"line-{i}" for i in range(CYCLES)]
        assert len(snapshots) == CYCLES  # a new snapshot per pause
        # retention keeps the newest 3 of this VM on disk
        vm_snaps = list(pal_server.data_dir.glob(f"snapshots/*/{vm}/*/meta.json"))
        assert 1 <= len(vm_snaps) <= 3
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_clock_and_identity_are_fresh_after_resume(api: httpx.Client, vm: str) -> None:
    before = sh(api, vm, "cat /proc/sys/kernel/random/uuid")["stdout"]
    # The guest's clock is set years back before the snapshot: a clock restored as it was
    # captured is then plainly wrong, with no need to wait for a frozen clock to lag.
    r = api.post(
        f"/v1/runtime/vms/{vm}/exec",
        json={
            "command": "/bin/sh",
            "argv": ["-c", "date -s @1000000000 >/dev/null; date +%s"],
            "user": "root",
        },
    )
    assert r.status_code == 200 and int(r.json()["stdout"]) < 1_000_000_100, r.text
    assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
    assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
    assert_guest_clock_is_the_hosts(lambda: float(sh(api, vm, "date +%s.%N")["stdout"]))
    assert sh(api, vm, "cat /proc/sys/kernel/random/uuid")["stdout"] != before
    # The resume's status event says how the VM came up and where the time went: here by
    # its parked QEMU (the pause kept it), which still took a new identity (clock, RNG).
    details = _last_up(api, vm)
    assert details["method"] == "restore" and details["warm"] is True and details["bootMs"] > 0, details
    for step in ("prepare_ms", "qemu_cont_ms", "identify_reply_ms", "identify_guest_clock_rng_us"):
        assert details["timings"][step] >= 0, (step, details)


def _last_up(api: httpx.Client, vm: str) -> dict:
    up = [e for e in api.get(f"/v1/runtime/vms/{vm}/events").json()["events"] if e["toState"] == "running"]
    return dict(up[-1]["details"])


def test_a_paused_vm_parks_its_qemu_and_its_resume_continues_it(
    pal_server: PalServer, api: httpx.Client
) -> None:
    """The QEMU of a snapshot-paused VM is parked (stopped, its guest RAM handed back) and
    its resume continues that same process instead of starting a new one: the guest's
    memory is the snapshot's, its identity new. Without its parked QEMU the VM restores
    from the snapshot into a new one, as before."""
    vm = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    vm_dir = vm_dir_of(pal_server.data_dir, vm)
    try:
        (pid,) = qemu_pids_under(vm_dir)
        sh(api, vm, "echo in-memory > /dev/shm/state")
        assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
        assert qemu_pids_under(vm_dir) == [pid], "parked, not killed"
        assert_runs_no_guest(vm_dir)  # no guest runs; its RAM is back with the host
        assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
        assert qemu_pids_under(vm_dir) == [pid], "the same process continues"
        assert _last_up(api, vm)["warm"] is True
        assert sh(api, vm, "cat /dev/shm/state")["stdout"] == "in-memory\n"
        # Its snapshot gone from this node (as after a resume on another node): the parked
        # QEMU is not used, and the resume restores the snapshot (here from nowhere: 404).
        assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
        for meta in pal_server.data_dir.glob(f"snapshots/*/{vm}/*/meta.json"):
            meta.unlink()
        r = api.post(f"/v1/runtime/vms/{vm}/resume")
        assert r.status_code in (404, 503), r.text
        assert qemu_pids_under(vm_dir) == [], "the parked QEMU was let go"
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")
    assert qemu_pids_under(vm_dir) == []


def test_memory_the_guest_frees_leaves_the_host_and_its_next_snapshot(
    pal_server: PalServer, api: httpx.Client
) -> None:
    """Issue 39: the guest reports the pages it frees (virtio-balloon free page reporting),
    QEMU punches them out of the VM's own RAM file: they leave the host, and the next
    snapshot does not carry them. What the guest kept is intact."""
    vm = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    ram = vm_dir_of(pal_server.data_dir, vm) / "mem"
    try:
        sh(api, vm, "head -c 64M /dev/urandom > /dev/shm/big && echo kept > /dev/shm/state")
        full = api.post(f"/v1/runtime/vms/{vm}/pause").json()["snapshotId"]
        assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
        (full_mem,) = pal_server.data_dir.glob(f"snapshots/*/{vm}/{full}/mem")
        with_big = data_mib(full_mem)
        sh(api, vm, "rm /dev/shm/big")
        deadline = time.monotonic() + 300  # a hang guard: the guest reports 2 s after a free
        while data_mib(ram) > with_big - 48:
            assert time.monotonic() < deadline, f"the freed 64 MiB stayed in {ram} ({data_mib(ram):.0f} MiB)"
            time.sleep(0.5)
        smaller = api.post(f"/v1/runtime/vms/{vm}/pause").json()["snapshotId"]
        (smaller_mem,) = pal_server.data_dir.glob(f"snapshots/*/{vm}/{smaller}/mem")
        assert data_mib(smaller_mem) <= with_big - 48, "the next snapshot carries no freed page"
        assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
        assert sh(api, vm, "cat /dev/shm/state; ls /dev/shm")["stdout"] == "kept\nstate\n"
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_wrong_state_calls_are_409(api: httpx.Client, vm: str) -> None:
    assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 409
    assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "true"})
    assert r.status_code == 409, "a VM paused by an operator is never auto-resumed"
    assert api.get(f"/v1/runtime/vms/{vm}/files", params={"path": ""}).status_code == 409
    assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 409
    assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
    assert api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "true"}).json()["exitCode"] == 0


def test_paused_vm_frees_its_slot_and_resume_needs_one(pal_server: PalServer) -> None:
    key = pal_server.tenant("it-pause-quota", max_vms=1)
    with pal_server.client(key) as c:
        a = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
        assert c.post(f"/v1/runtime/vms/{a}/pause").status_code == 200
        r = c.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, "the paused VM's slot was freed"
        b = r.json()["vmId"]
        r = c.post(f"/v1/runtime/vms/{a}/resume")
        assert r.status_code == 402, r.text
        assert c.get(f"/v1/runtime/vms/{a}").json()["state"] == "paused"
        c.delete(f"/v1/runtime/vms/{b}")
        assert c.post(f"/v1/runtime/vms/{a}/resume").status_code == 200
        c.delete(f"/v1/runtime/vms/{a}")


def test_delete_paused_vm(pal_server: PalServer, api: httpx.Client) -> None:
    vm = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    api.post(f"/v1/runtime/vms/{vm}/pause")
    snaps = list(pal_server.data_dir.glob(f"snapshots/*/{vm}"))
    assert snaps and any(snaps[0].iterdir())
    r = api.delete(f"/v1/runtime/vms/{vm}")
    assert r.status_code == 200 and r.json()["state"] == "terminated"
    assert not any(pal_server.data_dir.glob(f"snapshots/*/{vm}"))  # its snapshots went with it


def test_snapshot_layout_and_meta(pal_server: PalServer, api: httpx.Client, vm: str) -> None:
    snap = api.post(f"/v1/runtime/vms/{vm}/pause").json()["snapshotId"]
    metas = list(pal_server.data_dir.glob(f"snapshots/*/{vm}/{snap}/meta.json"))
    assert len(metas) == 1
    d = metas[0].parent
    assert {p.name for p in d.iterdir()} >= {"snapshot", "mem", "rootfs", "meta.json"}
    meta = json.loads(metas[0].read_text())
    assert meta["vmId"] == vm and meta["tenantId"]
    # The big artifacts' checksums are added by the background seal shortly after the pause.
    deadline = time.time() + 300  # a hang guard, not a speed bound
    while not meta.get("sealed") and time.time() < deadline:
        time.sleep(0.2)
        meta = json.loads(metas[0].read_text())
    assert meta["sealed"] is True
    for art in ("snapshot", "mem", "rootfs"):
        assert len(meta["sha256"][art]) == 64
        assert meta["sizes"][art] == (d / art).stat().st_size
    assert not list(pal_server.data_dir.glob("snapshots/.staging/*")), "no half-written snapshot left"
    api.post(f"/v1/runtime/vms/{vm}/resume")


def test_other_tenant_cannot_resume_or_fork(pal_server: PalServer, api: httpx.Client, vm: str) -> None:
    api.post(f"/v1/runtime/vms/{vm}/pause")
    other = pal_server.tenant("it-other-snap", max_vms=2)
    with pal_server.client(other) as o:
        assert o.post(f"/v1/runtime/vms/{vm}/resume").json()["error"]["code"] == "NOT_FOUND"
        assert o.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 1}).status_code == 404
    api.post(f"/v1/runtime/vms/{vm}/resume")
