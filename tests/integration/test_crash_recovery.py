"""Issue: crash safety — a QEMU killed, the server stopped or killed around running VMs
and their network: after a restart every VM is in a true state and no quota slot leaks.

The server killed at each named failpoint of every operation (``PAL_FAILPOINT``) is the
kill -9 matrix: tests/adversarial/test_kill_matrix.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    gateway_pids_under,
    netns_of,
    qemu_pids_under,
    scratch_run_dir,
    start_server,
    stop_server,
)
from tests.leaks import vm_dir_of
from tests.netservers import HELLO, Upstream

pytestmark = pytest.mark.vm

MAX_VMS = 3


@pytest.fixture
def run_dir(warm_template: None) -> Iterator[Path]:
    with scratch_run_dir("crash") as d:
        yield d


def free_slots(c: httpx.Client) -> int:
    """How many more VMs the tenant can schedule right now (then deletes them)."""
    made = []
    try:
        for _ in range(MAX_VMS + 1):
            r = c.post("/v1/runtime/schedule", json={})
            if r.status_code == 402:
                break
            assert r.status_code == 200, r.text
            made.append(r.json()["vmId"])
        return len(made)
    finally:
        for v in made:
            c.delete(f"/v1/runtime/vms/{v}")


def test_qemu_killed_is_reported_failed_and_frees_its_slot(run_dir) -> None:
    # No parked QEMUs: the resumes below must restore from the snapshot (and meet its
    # damage); a parked one would continue without reading it (pal/manager/parked.py).
    server = start_server(run_dir, extra_env={"PAL_PARKED_MAX": "0"})
    try:
        key = server.tenant("qemu-kill", max_vms=MAX_VMS)
        with server.client(key, timeout=60) as c:
            vm = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
            (pid,) = qemu_pids_under(vm_dir_of(run_dir, vm))
            os.kill(pid, signal.SIGKILL)
            deadline = time.time() + 300  # a hang guard, not a speed bound
            while time.time() < deadline and c.get(f"/v1/runtime/vms/{vm}").json()["state"] != "failed":
                time.sleep(0.3)
            got = c.get(f"/v1/runtime/vms/{vm}").json()
            assert got["state"] == "failed" and got["reason"], got
            assert free_slots(c) == MAX_VMS
            assert c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "true"}).status_code == 409
            assert c.post(f"/v1/runtime/vms/{vm}/pause").status_code == 409

            # A QEMU that dies while a resume restores it leaves the VM paused and resumable.
            vm2 = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
            c.put(f"/v1/runtime/vms/{vm2}/files/content", params={"path": "x"}, content="x")
            assert c.post(f"/v1/runtime/vms/{vm2}/pause").status_code == 200
            snap_dirs = list(run_dir.glob(f"snapshots/*/{vm2}/*/snapshot"))
            assert snap_dirs
            # Make the restore fail for real: a damaged device-state file.
            victim = snap_dirs[0]
            good = victim.read_bytes()
            victim.write_bytes(b"garbage" * 10)
            r = c.post(f"/v1/runtime/vms/{vm2}/resume")
            assert r.status_code >= 500, r.text
            assert c.get(f"/v1/runtime/vms/{vm2}").json()["state"] == "paused"
            assert qemu_pids_under(run_dir / "vms") == [], "no QEMU left by the failed restore"
            victim.write_bytes(good)
            assert c.post(f"/v1/runtime/vms/{vm2}/resume").status_code == 200
            assert c.get(f"/v1/runtime/vms/{vm2}/files/content", params={"path": "x"}).text == "x"
            # Its RAM changed behind Pal's back once sealed: refused before any QEMU maps it
            # (docs/security.md, local snapshots), the VM stays paused, nothing is lost.
            snap = c.post(f"/v1/runtime/vms/{vm2}/pause").json()["snapshotId"]
            (mem,) = run_dir.glob(f"snapshots/*/{vm2}/{snap}/mem")
            deadline = time.time() + 300  # a hang guard: the background seal
            while time.time() < deadline and not json.loads((mem.parent / "meta.json").read_text())["sealed"]:
                time.sleep(0.1)
            with open(mem, "r+b") as f:
                f.seek(4096)
                byte = f.read(1)
                f.seek(4096)
                f.write(bytes([byte[0] ^ 0xFF]))
            r = c.post(f"/v1/runtime/vms/{vm2}/resume")
            assert r.status_code >= 500 and "['mem'] fail their checksums" in r.text, r.text
            assert c.get(f"/v1/runtime/vms/{vm2}").json()["state"] == "paused"
            with open(mem, "r+b") as f:
                f.seek(4096)
                f.write(byte)
            assert c.post(f"/v1/runtime/vms/{vm2}/resume").status_code == 200
            assert c.get(f"/v1/runtime/vms/{vm2}/files/content", params={"path": "x"}).text == "x"
            c.delete(f"/v1/runtime/vms/{vm2}")
            c.delete(f"/v1/runtime/vms/{vm}")
    finally:
        stop_server(server)


def test_sigterm_suspends_running_vms_and_a_restart_wakes_them(run_dir) -> None:
    server = start_server(run_dir)
    key = server.tenant("restart", max_vms=MAX_VMS)
    with server.client(key, timeout=60) as c:
        r0 = c.post("/v1/runtime/schedule", json={})
        assert r0.status_code == 200, (r0.text, server.log_tail())
        vm = r0.json()["vmId"]
        c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", "echo 9 > /tmp/mem"]})
    stop_server(server)  # SIGTERM
    assert server.proc.returncode == 0
    assert qemu_pids_under(run_dir) == [], "no QEMU outlives the server"
    server = start_server(run_dir)
    try:
        with server.client(key, timeout=60) as c:
            got = c.get(f"/v1/runtime/vms/{vm}").json()
            assert got["state"] == "paused" and "shutdown" in got["reason"]
            assert free_slots(c) == MAX_VMS
            out = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "cat", "argv": ["/tmp/mem"]})
            assert out.status_code == 200 and out.json()["stdout"] == "9\n", out.text
            assert c.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"
            c.delete(f"/v1/runtime/vms/{vm}")
    finally:
        stop_server(server)


def _fetch(c: httpx.Client, vm: str, url: str) -> str:
    r = c.post(
        f"/v1/runtime/vms/{vm}/exec", json={"command": "curl", "argv": ["-sS", "--max-time", "30", url]}
    )
    assert r.status_code == 200, r.text
    return str(r.json()["stdout"])


def test_network_comes_back_after_a_server_or_gateway_crash(run_dir, upstream: Upstream) -> None:
    url = f"http://api.test:{upstream.http_port}/hello"
    tls_url = f"https://api.test:{upstream.tls_port}/headers"
    env = {"PAL_EGRESS_CA_BUNDLE": str(upstream.ca_path)}
    real = "sk-crash-" + uuid.uuid4().hex
    brokered = {
        "value": real,
        "brokered": {"hosts": ["api.test"], "header": "Authorization", "format": "Bearer {value}"},
    }
    # A name entry without a port allows 80 and 443 only: the test servers' ports are listed.
    allow = [f"api.test:{upstream.http_port}", f"api.test:{upstream.tls_port}"]
    server = start_server(run_dir, env)
    key = server.tenant("net-crash", max_vms=MAX_VMS)
    with server.client(key, timeout=60) as c:
        spec = {"egress": {"allow": allow}, "secrets": {"KEY": brokered}}
        vm = c.post("/v1/runtime/schedule", json=spec).json()["vmId"]
        assert _fetch(c, vm, url) == HELLO.decode()
    (gw,) = gateway_pids_under(run_dir)
    server.proc.kill()  # kill -9: the gateway and the VM live on
    server.proc.wait(60)
    assert gateway_pids_under(run_dir) == [gw]
    server = start_server(run_dir, env)
    try:
        with server.client(key, timeout=60) as c:
            assert c.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"
            assert gateway_pids_under(run_dir) == [gw], "the gateway was adopted, not replaced"
            assert _fetch(c, vm, url) == HELLO.decode()
            # The gateway itself dies: the node restarts it and registers the VM again.
            os.kill(gw, signal.SIGKILL)
            deadline = time.time() + 60
            while time.time() < deadline and gateway_pids_under(run_dir) in ([], [gw]):
                time.sleep(0.2)
            out = ""
            while time.time() < deadline and out != HELLO.decode():
                out = _fetch(c, vm, url)
            assert out == HELLO.decode()
            # The restarted gateway got the brokered secret from the adopted VM's (sealed)
            # record: requests to its host carry the real value again.
            n0 = len(upstream.received)
            assert _fetch(c, vm, tls_url)
            assert upstream.received[n0:][-1]["Authorization"] == f"Bearer {real}"
            r = c.get(f"/v1/runtime/vms/{vm}").json()
            assert r["egress"] == {"allow": allow}
            c.delete(f"/v1/runtime/vms/{vm}")
    finally:
        stop_server(server)
    assert qemu_pids_under(run_dir) == [] and gateway_pids_under(run_dir) == []
    assert netns_of(run_dir) == [], "no namespace outlives its VM"
