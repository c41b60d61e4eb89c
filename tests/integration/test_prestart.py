"""Pre-started restores (pal/manager/prestart.py) with real VMs: a resume into a new QEMU
and a fork child each take a QEMU that was waiting in ``-incoming defer`` (the same
process, in its slot), come up with their disk and memory intact and their own identity,
stay apart from each other, and the set starts new QEMUs; nothing is left behind."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PalServer, qemu_pids_under, scratch_run_dir, start_server, stop_server
from tests.integration.test_pool import node_metric
from tests.leaks import data_mib, prestarted_qemus, problems, vm_dir_of, vm_slots

pytestmark = pytest.mark.vm

# Every resume restores into a new QEMU (no parked one), so it may take a pre-started one.
PRESTART_ENV = {"PAL_PRESTART": "256m-1c-2048d:2", "PAL_PARKED_MAX": "0"}
DEADLINE_S = 600  # a hang guard, not a speed bound (TCG on a busy host)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    with scratch_run_dir("prestart") as d:
        yield d


def wait_prestarted(
    server: PalServer, n: int, not_among: set[str] | frozenset[str] = frozenset()
) -> dict[str, int]:
    """Block until ``n`` QEMUs wait for a restore (none in a slot of ``not_among``), each
    one live process; slot -> its QEMU's pid."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        slots = set(prestarted_qemus(server.data_dir).values())
        pids = {s: qemu_pids_under(server.data_dir / "vms" / s) for s in slots}
        if len(slots) == n and not slots & not_among and all(len(p) == 1 for p in pids.values()):
            return {s: p[0] for s, p in pids.items()}
        assert server.proc.poll() is None, server.log_tail()
        time.sleep(0.3)
    raise AssertionError(f"{n} pre-started QEMUs never waited:\n{server.log_tail()}")


def sh(c: httpx.Client, vm: str, line: str) -> str:
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return str(r.json()["stdout"])


def up_timings(c: httpx.Client, vm: str) -> dict[str, Any]:
    """The node's timings of the VM's latest coming up (its `running` status event)."""
    events = c.get(f"/v1/runtime/vms/{vm}/events").json()["events"]
    up = [e for e in events if e.get("toState") == "running" and isinstance(e.get("details"), dict)]
    return dict(up[-1]["details"].get("timings") or {}) if up else {}


def with_data(c: httpx.Client) -> str:
    """A running VM with a file on its disk and a marker in its memory (tmpfs)."""
    r = c.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    vm = str(r.json()["vmId"])
    sh(c, vm, "echo on-disk > $HOME/f.txt && sync && echo in-memory > /tmp/mem")
    return vm


def assert_data(c: httpx.Client, vm: str) -> None:
    assert sh(c, vm, "cat $HOME/f.txt /tmp/mem") == "on-disk\nin-memory\n"


def test_a_resume_and_a_fork_child_take_prestarted_qemus_with_their_data_intact(run_dir: Path) -> None:
    server = start_server(run_dir, PRESTART_ENV)
    try:
        key = server.tenant("prestart", max_vms=4)
        with server.client(key, timeout=DEADLINE_S) as c:
            vm = with_data(c)
            assert c.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
            waiting = wait_prestarted(server, 2)
            r = c.post(f"/v1/runtime/vms/{vm}/resume")
            assert r.status_code == 200, r.text
            # The resume took one of the waiting QEMUs: its slot and its very process.
            slot = vm_slots(run_dir)[vm]
            assert slot in waiting and qemu_pids_under(run_dir / "vms" / slot) == [waiting[slot]]
            assert up_timings(c, vm).get("prestarted") == 1
            assert_data(c, vm)
            assert sh(c, vm, "hostname").strip() == vm[:63]

            r = c.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 1})
            assert r.status_code == 200, r.text
            (child,) = [f["vmId"] for f in r.json()["forks"] if f["state"] == "running"]
            child_slot = vm_slots(run_dir)[child]
            assert child_slot in waiting and child_slot != slot, "two restores, two QEMUs"
            assert qemu_pids_under(run_dir / "vms" / child_slot) == [waiting[child_slot]]
            assert up_timings(c, child).get("prestarted") == 1
            assert_data(c, child)
            assert sh(c, child, "hostname").strip() == child[:63]
            # The child's disk and memory are its own copies: its writes stay in it.
            sh(c, child, "echo child > $HOME/f.txt && echo child > /tmp/mem")
            assert_data(c, vm)
            # A child on a pre-started QEMU pauses and resumes like any VM (its RAM is a file).
            assert c.post(f"/v1/runtime/vms/{child}/pause").status_code == 200
            assert c.post(f"/v1/runtime/vms/{child}/resume").status_code == 200
            assert sh(c, child, "cat $HOME/f.txt /tmp/mem") == "child\nchild\n"

            # The set starts new QEMUs, never in the slots the VMs took.
            wait_prestarted(server, 2, not_among={slot, child_slot})
            assert node_metric(server, "pal_prestart_takes") >= 2  # the child's resume may take one too
            ready, target = (node_metric(server, f"pal_prestart_{f}") for f in ("ready", "target"))
            assert ready == target == 2
            assert node_metric(server, "pal_prestart_rss_bytes") > 0
            assert problems(run_dir) == []
            for v in (child, vm):
                assert c.delete(f"/v1/runtime/vms/{v}").status_code == 200
            wait_prestarted(server, 2, not_among={slot, child_slot})
            assert problems(run_dir) == []
    finally:
        stop_server(server)
    assert qemu_pids_under(run_dir / "vms") == [], "a stopped server leaves no pre-started QEMU"


def ram_kib(pid: int, memory_mib: int = 256) -> tuple[int, int]:
    """(Rss, Pss) in KiB of the QEMU's guest RAM mapping (the file-backed one of its size)."""
    got, cur = [0, 0], False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = hi - lo == memory_mib << 20 and len(line.split()) > 5
        elif cur and head in ("Rss:", "Pss:"):
            got[head == "Pss:"] += int(line.split()[1])
    return got[0], got[1]


def test_ten_copies_of_one_snapshot_share_its_pages_and_a_copy_that_frees_hurts_no_sibling(
    run_dir: Path,
) -> None:
    """Issue 39: with pre-started QEMUs waiting, ten copies of a guest holding state map one
    page cache (each copy's guest RAM costs a fraction of the snapshot); and a copy whose
    guest frees that state gives its pages back without taking them from its siblings."""
    server = start_server(run_dir, PRESTART_ENV)
    try:
        key = server.tenant("prestart-copies", max_vms=11)
        with server.client(key, timeout=DEADLINE_S) as c:
            src = str(c.post("/v1/runtime/schedule", json={}).json()["vmId"])
            state = sh(c, src, "head -c 48M /dev/urandom > /dev/shm/state && md5sum /dev/shm/state")
            wait_prestarted(server, 2)  # there to be taken, if a copy wrongly would
            r = c.post(f"/v1/runtime/vms/{src}/fork", json={"count": 10})
            assert r.status_code == 200, r.text
            snap = r.json()["snapshotId"]
            kids = [f["vmId"] for f in r.json()["forks"] if f["state"] == "running"]
            assert len(kids) == 10, r.text
            for k in kids:
                assert sh(c, k, "md5sum /dev/shm/state") == state  # reads every page of it
            (snap_mem,) = run_dir.glob(f"snapshots/*/{src}/{snap}/mem")
            snap_data = data_mib(snap_mem)
            pids = {k: qemu_pids_under(vm_dir_of(run_dir, k))[0] for k in kids}
            ram = {k: ram_kib(pid) for k, pid in pids.items()}
            # Alone, a copy's guest RAM would hold the state and what its kernel touched: over
            # a third of the snapshot. Shared ten ways, each holds a tenth of that and its own.
            unshared = {
                k: (rss >> 10, pss >> 10) for k, (rss, pss) in ram.items() if pss >> 10 > snap_data / 3
            }
            assert not unshared, (
                f"copies that share no page of the snapshot ({snap_data:.0f} MiB): {unshared}"
            )

            # One copy frees its state: its guest reports the pages, its QEMU drops them...
            first, other = kids[0], kids[1]
            rss_before = ram[first][0]
            sh(c, first, "rm /dev/shm/state")
            deadline = time.monotonic() + DEADLINE_S
            while ram_kib(pids[first])[0] > rss_before - (32 << 10):
                assert time.monotonic() < deadline, "the guest's freed pages never left its QEMU"
                time.sleep(0.5)
            # ...and neither the fork memory its siblings map nor their state lost a byte.
            fork_mem = run_dir / "snapshots" / ".fork-mem" / f"{snap}.mem"
            assert data_mib(fork_mem) == snap_data
            assert sh(c, other, "md5sum /dev/shm/state") == state
            for v in (*kids, src):
                assert c.delete(f"/v1/runtime/vms/{v}").status_code == 200
            assert problems(run_dir) == []
    finally:
        stop_server(server)


def test_with_prestart_off_a_resume_starts_its_own_qemu(run_dir: Path) -> None:
    server = start_server(run_dir, {**PRESTART_ENV, "PAL_PRESTART": "0"})
    try:
        key = server.tenant("prestart-off", max_vms=2)
        with server.client(key, timeout=DEADLINE_S) as c:
            vm = with_data(c)
            assert c.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
            assert c.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
            assert prestarted_qemus(run_dir) == {}
            assert "prestarted" not in up_timings(c, vm) and "qemu_spawn_ms" in up_timings(c, vm)
            assert_data(c, vm)
            assert c.delete(f"/v1/runtime/vms/{vm}").status_code == 200
            assert problems(run_dir) == []
    finally:
        stop_server(server)
