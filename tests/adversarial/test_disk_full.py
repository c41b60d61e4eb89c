"""Issue 9, 7.4: a full data disk, on a small loop file system.

`pal up` on a ``mktemp -d`` data dir whose loop-mounted XFS is 4 GiB. One VM is paused
(its snapshot must survive), another runs; then the disk is filled until a snapshot of the
running VM cannot fit. Its pause fails cleanly (507, nothing written, nothing stopped),
the VM keeps running with its memory and files, the paused VM's snapshot still restores,
and once space is freed the same pause succeeds.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pal.manager.admission import MIN_FREE_MIB, disk_free_mib
from pal.sizes import DEFAULT_DISK_MIB
from tests.conftest import PalServer, private_data_dir, start_server, stop_server

pytestmark = pytest.mark.vm

MEMORY_MIB = 256


@pytest.fixture(scope="module")
def small_server() -> Iterator[PalServer]:
    mp = pytest.MonkeyPatch()
    mp.setenv("PAL_XFS_IMAGE_GIB", "4")  # the loop XFS private_data_dir makes
    try:
        with private_data_dir() as data:
            assert os.path.ismount(data) and stat.S_IMODE(data.parent.stat().st_mode) == 0o700
            # No warm template: its files would take a quarter of this small disk.
            server = start_server(data, {"PAL_TEMPLATES": "0"}, share_cache=False)
            try:
                yield server
            finally:
                stop_server(server)
    finally:
        mp.undo()


def schedule(c: httpx.Client, spec: dict[str, object]) -> str:
    r = c.post("/v1/runtime/schedule", json=spec)
    assert r.status_code == 200, r.text
    return str(r.json()["vmId"])


def run(c: httpx.Client, vm: str, script: str) -> str:
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", script]})
    assert r.status_code == 200, r.text
    assert r.json()["exitCode"] == 0, r.json()
    return str(r.json()["stdout"])


def fill(data: Path, leave_mib: int) -> Path:
    """A file taking all free space on ``data``'s file system but ``leave_mib``."""
    filler = data / "filler"
    size = (disk_free_mib(data) - leave_mib) * (1 << 20)
    assert size > 0
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    return filler


def reported_free_mib(server: PalServer, at_least: int) -> int:
    """Wait until the node reports ``at_least`` MiB free on its data disk (GET /v1/nodes)."""
    operator = {"Authorization": f"Bearer {server.operator_token}"}
    deadline = time.monotonic() + 120  # a hang guard: a heartbeat is due every 5 s
    while True:
        r = httpx.get(server.url + "/v1/nodes", headers=operator, timeout=60)
        assert r.status_code == 200, r.text
        (node,) = r.json()["nodes"]
        free = int(node["capacity"]["diskFreeMib"])
        if free >= at_least:
            return free
        assert time.monotonic() < deadline, node
        time.sleep(0.5)


def test_a_pause_on_a_full_disk_fails_cleanly_and_the_vm_runs_on(small_server: PalServer) -> None:
    data = small_server.data_dir
    key = small_server.tenant("full")
    with small_server.client(key) as c:
        spec: dict[str, object] = {"limits": {"memoryMib": MEMORY_MIB}}
        paused, running = (schedule(c, spec) for _ in range(2))
        run(c, paused, "echo before > /tmp/mem-only")
        r = c.post(f"/v1/runtime/vms/{paused}/pause")
        assert r.status_code == 200, r.text
        run(c, running, "echo state > /tmp/mem-only")
        r = c.put(f"/v1/runtime/vms/{running}/files/content", params={"path": "f.txt"}, content=b"kept")
        assert r.status_code == 200, r.text

        filler = fill(data, MEMORY_MIB + MIN_FREE_MIB - 64)  # a snapshot no longer fits
        try:
            r = c.post(f"/v1/runtime/vms/{running}/pause")
            assert r.status_code == 507, r.text
            err = r.json()["error"]
            assert err["code"] == "INSUFFICIENT_STORAGE" and "disk" in err["message"], err
            assert str(data) not in err["message"]  # no host paths in API errors
            assert c.get(f"/v1/runtime/vms/{running}").json()["state"] == "running"
            # The VM runs on with its memory and files; nothing was written for the pause.
            assert run(c, running, "cat /tmp/mem-only /workspace/f.txt") == "state\nkept"
            written = [
                *(data / "snapshots").glob(f"*/{running}/*"),
                *(data / "snapshots" / ".staging").glob("*"),
            ]
            assert not written, written
        finally:
            filler.unlink()
        # Placement reads the space the node last reported (its heartbeat, every few s): a
        # heartbeat taken while the disk was full refuses the resume until the next one.
        reported_free_mib(small_server, at_least=DEFAULT_DISK_MIB)

        # Nothing is corrupt: the earlier snapshot restores, and the refused pause now works.
        r = c.post(f"/v1/runtime/vms/{paused}/resume")
        assert r.status_code == 200, r.text
        assert run(c, paused, "cat /tmp/mem-only") == "before\n"
        r = c.post(f"/v1/runtime/vms/{running}/pause")
        assert r.status_code == 200, r.text
        r = c.post(f"/v1/runtime/vms/{running}/resume")
        assert r.status_code == 200, r.text
        assert run(c, running, "cat /tmp/mem-only /workspace/f.txt") == "state\nkept"
        for vm in (paused, running):
            c.delete(f"/v1/runtime/vms/{vm}")
