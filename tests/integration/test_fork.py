"""Issue: fork ×N — children share the source's memory copy-on-write, own disk and identity."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import PalServer, assert_guest_clock_is_the_hosts, qemu_pids_under
from tests.leaks import vm_dir_of

pytestmark = pytest.mark.vm


def sh(api: httpx.Client, vm: str, line: str) -> dict:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200, r.text
    return r.json()


def test_fork_10_children_share_state_but_not_writes(pal_server: PalServer, api: httpx.Client) -> None:
    src = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    kids: list[str] = []
    try:
        api.put(f"/v1/runtime/vms/{src}/files/content", params={"path": "seed.txt"}, content="from parent\n")
        sh(api, src, "setsid sleep 100000 >/dev/null 2>&1 & echo $! > /tmp/bg.pid")
        bg_pid = sh(api, src, "cat /tmp/bg.pid")["stdout"].strip()
        r = api.post(f"/v1/runtime/vms/{src}/fork", json={"count": 10})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["sourceVmId"] == src and body["snapshotId"]
        kids = [f["vmId"] for f in body["forks"]]
        assert len(set(kids)) == 10 and src not in kids
        bad = [f for f in body["forks"] if f["state"] != "running" or "error" in f]
        assert not bad, bad
        # the source keeps running
        assert api.get(f"/v1/runtime/vms/{src}").json()["state"] == "running"
        assert sh(api, src, "echo ok")["stdout"] == "ok\n"

        randoms = set()
        for i, k in enumerate(kids):
            got = api.get(f"/v1/runtime/vms/{k}").json()
            assert got["state"] == "running" and got["parentVmId"] == src
            assert (
                api.get(f"/v1/runtime/vms/{k}/files/content", params={"path": "seed.txt"}).text
                == "from parent\n"
            )
            assert sh(api, k, f"kill -0 {bg_pid} && echo alive")["stdout"] == "alive\n"
            randoms.add(sh(api, k, "head -c 16 /dev/urandom | od -An -tx1")["stdout"])
            assert_guest_clock_is_the_hosts(lambda k=k: float(sh(api, k, "date +%s.%N")["stdout"]))
            api.put(f"/v1/runtime/vms/{k}/files/content", params={"path": "mine.txt"}, content=f"child {i}\n")
        assert len(randoms) == 10, "every child's RNG was reseeded"
        # writes stay private: siblings and the parent don't see them
        for i, k in enumerate(kids):
            assert (
                api.get(f"/v1/runtime/vms/{k}/files/content", params={"path": "mine.txt"}).text
                == f"child {i}\n"
            )
        assert api.get(f"/v1/runtime/vms/{src}/files/content", params={"path": "mine.txt"}).status_code == 404
        # The children map a reflinked copy of the snapshot's RAM, never the artifact itself.
        snap = body["snapshotId"]
        fork_mem = pal_server.data_dir / "snapshots" / ".fork-mem" / f"{snap}.mem"
        assert fork_mem.exists()
        kid_dirs = [vm_dir_of(pal_server.data_dir, k) for k in kids]
        for kid_dir in kid_dirs:
            (pid,) = qemu_pids_under(kid_dir)
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert str(fork_mem) in maps and f"/{snap}/mem" not in maps
    finally:
        for k in [*kids, src]:
            api.delete(f"/v1/runtime/vms/{k}")
    for kid_dir in kid_dirs:
        assert qemu_pids_under(kid_dir) == []
    assert not fork_mem.exists(), "the copy goes with the last child that maps it"


def test_fork_count_validation(api: httpx.Client, vm: str) -> None:
    for count in (0, -1, 1001, "three"):
        r = api.post(f"/v1/runtime/vms/{vm}/fork", json={"count": count})
        assert r.status_code == 400, (count, r.text)
    assert api.post(f"/v1/runtime/vms/{vm}/fork", json={}).status_code == 400


def test_fork_beyond_quota_is_402_and_leaves_nothing(pal_server: PalServer) -> None:
    key = pal_server.tenant("it-fork-quota", max_vms=3)
    with pal_server.client(key) as c:
        src = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
        before = c.get("/v1/runtime/vms").json()["vms"]
        r = c.post(f"/v1/runtime/vms/{src}/fork", json={"count": 3})
        assert r.status_code == 402, r.text
        after = c.get("/v1/runtime/vms").json()["vms"]
        assert len(after) == len(before), "no child VM was created"
        r = c.post(f"/v1/runtime/vms/{src}/fork", json={"count": 2})
        assert r.status_code == 200, "the slots were not leaked by the refused fork"
        for f in r.json()["forks"]:
            c.delete(f"/v1/runtime/vms/{f['vmId']}")
        c.delete(f"/v1/runtime/vms/{src}")


def test_fork_of_paused_vm_and_fork_of_fork_and_pause_of_fork(api: httpx.Client) -> None:
    src = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    made: list[str] = [src]
    try:
        sh(api, src, "echo v1 > state.txt")
        pause_snap = api.post(f"/v1/runtime/vms/{src}/pause").json()["snapshotId"]
        r = api.post(f"/v1/runtime/vms/{src}/fork", json={"count": 1})
        assert r.status_code == 200, r.text
        assert r.json()["snapshotId"] == pause_snap, "a paused source forks from its pause snapshot"
        child = r.json()["forks"][0]["vmId"]
        made.append(child)
        assert api.get(f"/v1/runtime/vms/{src}").json()["state"] == "paused"
        assert sh(api, child, "cat state.txt")["stdout"] == "v1\n"
        sh(api, child, "echo v2 > state.txt")
        # fork of a fork
        r = api.post(f"/v1/runtime/vms/{child}/fork", json={"count": 1})
        assert r.status_code == 200, r.text
        grandchild = r.json()["forks"][0]["vmId"]
        made.append(grandchild)
        assert api.get(f"/v1/runtime/vms/{grandchild}").json()["parentVmId"] == child
        assert sh(api, grandchild, "cat state.txt")["stdout"] == "v2\n"
        # a fork can be paused and resumed
        sh(api, child, "echo v3 > state.txt")
        assert api.post(f"/v1/runtime/vms/{child}/pause").status_code == 200
        assert api.post(f"/v1/runtime/vms/{child}/resume").status_code == 200
        assert sh(api, child, "cat state.txt")["stdout"] == "v3\n"
        # and paused again after that
        assert api.post(f"/v1/runtime/vms/{child}/pause").status_code == 200
        assert api.post(f"/v1/runtime/vms/{child}/resume").status_code == 200
        assert sh(api, child, "cat state.txt")["stdout"] == "v3\n"
    finally:
        for v in reversed(made):
            api.delete(f"/v1/runtime/vms/{v}")


def test_snapshots_live_forks_map_survive_retention_and_source_delete(
    pal_server: PalServer, api: httpx.Client
) -> None:
    src = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    kids: list[str] = []
    snaps: list[str] = []
    try:
        for i in range(4):  # four fork snapshots of one VM: retention keeps 3 + what is mapped
            sh(api, src, f"echo {i} > gen.txt")
            out = api.post(f"/v1/runtime/vms/{src}/fork", json={"count": 1}).json()
            snaps.append(out["snapshotId"])
            kids.append(out["forks"][0]["vmId"])
        assert api.delete(f"/v1/runtime/vms/{src}").status_code == 200
        first = list(pal_server.data_dir.glob(f"snapshots/*/{src}/{snaps[0]}/meta.json"))
        assert first, "the oldest fork snapshot is still mapped by a live child: kept"
        for i, k in enumerate(kids):
            assert sh(api, k, "cat gen.txt")["stdout"] == f"{i}\n"
        # once its child is gone, nothing protects it any more
        api.delete(f"/v1/runtime/vms/{kids[0]}")
        assert sh(api, kids[1], "echo still-fine")["stdout"] == "still-fine\n"
    finally:
        for v in [*kids, src]:
            api.delete(f"/v1/runtime/vms/{v}")
