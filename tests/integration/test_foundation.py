"""Issue: schedule, exec (buffered and streamed), files, quotas, auth and stop — on real VMs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import PalServer, qemu_pids_under
from tests.leaks import vm_dir_of

pytestmark = pytest.mark.vm

SHELL_LINE = {"command": "/bin/sh", "argv": ["-c", "echo hello; echo err >&2; exit 3"]}


def sse_events(resp: httpx.Response) -> list[tuple[str, dict]]:
    """(event, data) for every SSE event of a streamed response."""
    out: list[tuple[str, dict]] = []
    event = None
    for line in resp.iter_lines():
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and event:
            out.append((event, json.loads(line.split(":", 1)[1].strip())))
            event = None
    return out


def test_schedule_get_list_shape(api: httpx.Client, vm: str) -> None:
    r = api.get(f"/v1/runtime/vms/{vm}")
    assert r.status_code == 200
    body = r.json()
    assert body["vmId"] == vm
    assert body["state"] == "running"
    assert body["image"] == "default"
    assert body["limits"]["memoryMib"] == 256
    for key in ("createdAt", "snapshotId", "parentVmId", "reason"):
        assert key in body
    listed = api.get("/v1/runtime/vms").json()["vms"]
    assert vm in [v["vmId"] for v in listed]


def test_exec_buffered_returns_both_streams_and_exit_code(api: httpx.Client, vm: str) -> None:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=SHELL_LINE)
    assert r.status_code == 200, r.text
    pid = int(r.headers["X-Pal-Process-Id"])  # every exec is a process (docs/processes.md)
    assert r.json() == {"exitCode": 3, "stdout": "hello\n", "stderr": "err\n", "processId": pid}


def test_exec_sse_delivers_stdout_stderr_exit_in_order(api: httpx.Client, vm: str) -> None:
    with api.stream(
        "POST", f"/v1/runtime/vms/{vm}/exec", json=SHELL_LINE, headers={"Accept": "text/event-stream"}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
        header = r.headers.get("X-Pal-Process-Id")  # sent when it started within a second
    pid = events[0][1]["processId"]
    assert isinstance(pid, int) and header in (None, str(pid)), (events, header)
    assert api.get(f"/v1/runtime/vms/{vm}/processes/{pid}").json()["exitCode"] == 3
    assert events == [
        ("process", {"processId": pid}),
        ("stdout", {"data": "hello\n"}),
        ("stderr", {"data": "err\n"}),
        ("exit", {"exitCode": 3}),
    ]


def test_exec_sse_streams_output_as_it_happens(api: httpx.Client, vm: str) -> None:
    # The command cannot end before the test, having read "first", creates the gate.
    line = "echo first; while [ ! -e gate ]; do sleep 0.1; done; echo second"
    cmd = {"command": "/bin/sh", "argv": ["-c", line]}
    with api.stream(
        "POST", f"/v1/runtime/vms/{vm}/exec", json=cmd, headers={"Accept": "text/event-stream"}
    ) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines) == "event: process" and next(lines).startswith('data: {"processId":')
        assert next(lines) == "event: stdout" and next(lines) == 'data: {"data":"first\\n"}'
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "gate"}, content=b"")
        rest = list(lines)
    assert 'data: {"data":"second\\n"}' in rest and "event: exit" in rest


def test_exec_env_cwd_argv_are_execve_style(api: httpx.Client, vm: str) -> None:
    r = api.post(
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "printenv", "argv": ["GREETING"], "env": {"GREETING": "hi there"}},
    )
    assert {**r.json(), "processId": None} == {
        "exitCode": 0,
        "stdout": "hi there\n",
        "stderr": "",
        "processId": None,
    }
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "pwd"})
    assert r.json()["stdout"] == "/workspace\n"
    # argv is passed verbatim: no shell splitting of "a b"
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/echo", "argv": ["a b", "$HOME"]})
    assert r.json()["stdout"] == "a b $HOME\n"


def test_missing_executable_is_a_clean_error(api: httpx.Client, vm: str) -> None:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/no/such/binary"})
    assert r.status_code == 400, r.text
    assert "not found" in r.json()["error"]["message"]
    with api.stream(
        "POST",
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "nosuchcmd"},
        headers={"Accept": "text/event-stream"},
    ) as s:
        events = sse_events(s)
    assert events[-1][0] == "error" and "not found" in events[-1][1]["message"]


def test_file_round_trip_and_listing(api: httpx.Client, vm: str) -> None:
    r = api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "src/job.py"}, content="print('hi')\n")
    assert r.status_code == 200, r.text
    assert r.json() == {"path": "src/job.py", "bytesWritten": 12}
    r = api.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "src/job.py"})
    assert r.status_code == 200 and r.text == "print('hi')\n"
    assert "X-Pal-Truncated" not in r.headers
    listing = api.get(f"/v1/runtime/vms/{vm}/files", params={"path": "src"}).json()
    assert listing["path"] == "src" and listing["truncated"] is False
    assert listing["entries"] == [{"name": "job.py", "type": "file", "size": 12}]
    # The file API and exec see the same file, as the workload user.
    out = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "python3", "argv": ["src/job.py"]}).json()
    assert out["stdout"] == "hi\n"
    owner = api.post(
        f"/v1/runtime/vms/{vm}/exec", json={"command": "stat", "argv": ["-c", "%U", "src/job.py"]}
    )
    assert owner.json()["stdout"] == "pal\n"


@pytest.mark.parametrize("path", ["/etc/passwd", "../etc/passwd", "a/../../etc/passwd", "link/passwd"])
def test_path_escapes_are_400(api: httpx.Client, vm: str, path: str) -> None:
    api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "ln", "argv": ["-sfn", "/etc", "link"]})
    for method, url in (
        ("GET", f"/v1/runtime/vms/{vm}/files/content"),
        ("GET", f"/v1/runtime/vms/{vm}/files"),
        ("PUT", f"/v1/runtime/vms/{vm}/files/content"),
    ):
        r = api.request(method, url, params={"path": path}, content=b"x" if method == "PUT" else None)
        assert r.status_code == 400, (method, path, r.text)
        assert r.json()["error"]["code"]


def test_write_over_1mib_is_413_and_large_read_is_cut(api: httpx.Client, vm: str) -> None:
    mib = 1024 * 1024
    r = api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "big.txt"}, content=b"a" * (mib + 1))
    assert r.status_code == 413
    r = api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "ok.txt"}, content=b"a" * mib)
    assert r.status_code == 200 and r.json()["bytesWritten"] == mib
    # A file made inside the VM larger than the limit is cut and flagged on read.
    api.post(
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "/bin/sh", "argv": ["-c", "head -c 3000000 /dev/zero | tr '\\0' b > huge.txt"]},
    )
    r = api.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "huge.txt"})
    assert r.status_code == 200
    assert r.headers.get("X-Pal-Truncated") == "true"
    assert len(r.content) == mib and set(r.content) == {ord("b")}


def test_bad_requests_are_400_with_a_message(api: httpx.Client) -> None:
    cases = [
        (b"{not json", "json"),
        (json.dumps({"imagee": "default"}).encode(), "imagee"),
        (json.dumps({"limits": {"memoryMib": -5}}).encode(), "memoryMib"),
        (json.dumps({"limits": {"vcpus": 10_000}}).encode(), "vcpus"),
        (json.dumps({"image": "no-such-image"}).encode(), "no-such-image"),
    ]
    for body, word in cases:
        r = api.post("/v1/runtime/schedule", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert word.lower() in err["message"].lower(), err


def test_auth_tenancy_and_quota(pal_server: PalServer) -> None:
    r = httpx.get(pal_server.url + "/v1/runtime/vms")
    assert r.status_code == 401
    r = httpx.get(pal_server.url + "/v1/runtime/vms", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    k1 = pal_server.tenant("it-quota-a", max_vms=1)
    k2 = pal_server.tenant("it-quota-b", max_vms=1)
    with pal_server.client(k1) as a, pal_server.client(k2) as b:
        r = a.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, r.text
        vm_id = r.json()["vmId"]
        try:
            r = a.post("/v1/runtime/schedule", json={})
            assert r.status_code == 402, r.text
            assert r.json()["error"]["code"]
            # another tenant cannot see or touch it
            assert b.get(f"/v1/runtime/vms/{vm_id}").status_code == 404
            assert b.post(f"/v1/runtime/vms/{vm_id}/exec", json={"command": "true"}).status_code == 404
            assert b.delete(f"/v1/runtime/vms/{vm_id}").status_code == 404
            assert vm_id not in [v["vmId"] for v in b.get("/v1/runtime/vms").json()["vms"]]
        finally:
            assert a.delete(f"/v1/runtime/vms/{vm_id}").status_code == 200
        # the slot is free again
        r = a.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, r.text
        a.delete(f"/v1/runtime/vms/{r.json()['vmId']}")


def test_delete_leaves_no_qemu(pal_server: PalServer, api: httpx.Client) -> None:
    vm_id = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
    vm_dir = vm_dir_of(pal_server.data_dir, vm_id)
    assert qemu_pids_under(vm_dir), "a running VM has a QEMU process"
    r = api.delete(f"/v1/runtime/vms/{vm_id}")
    assert r.status_code == 200 and r.json()["state"] == "terminated"
    assert qemu_pids_under(vm_dir) == []
    assert api.get(f"/v1/runtime/vms/{vm_id}").json()["state"] == "terminated"
    assert api.post(f"/v1/runtime/vms/{vm_id}/exec", json={"command": "true"}).status_code == 409


def test_cold_boot_works_too(api: httpx.Client) -> None:
    r = api.post("/v1/runtime/schedule", json={"boot": "cold"})
    assert r.status_code == 200, r.text
    vm_id = r.json()["vmId"]
    try:
        assert r.json().get("bootMethod") == "cold"
        out = api.post(f"/v1/runtime/vms/{vm_id}/exec", json={"command": "cat", "argv": ["/proc/1/cmdline"]})
        assert "harness" in out.json()["stdout"]
    finally:
        api.delete(f"/v1/runtime/vms/{vm_id}")


def qemu_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def test_each_qemu_runs_as_its_own_unprivileged_uid(pal_server: PalServer, api: httpx.Client) -> None:
    vms = [api.post("/v1/runtime/schedule", json={}).json()["vmId"] for _ in range(2)]
    try:
        uids = []
        for vm_id in vms:
            (pid,) = qemu_pids_under(vm_dir_of(pal_server.data_dir, vm_id))
            uids.append(qemu_uid(pid))
        assert all(u >= 1000 for u in uids) and uids[0] != uids[1], uids
        # and the jail does not get in the way of the lifecycle
        assert api.post(f"/v1/runtime/vms/{vms[0]}/pause").status_code == 200
        assert api.post(f"/v1/runtime/vms/{vms[0]}/resume").status_code == 200
        (pid,) = qemu_pids_under(vm_dir_of(pal_server.data_dir, vms[0]))
        assert qemu_uid(pid) >= 1000
    finally:
        for vm_id in vms:
            api.delete(f"/v1/runtime/vms/{vm_id}")


def test_each_qemu_runs_under_its_own_host_limits(pal_server: PalServer, api: httpx.Client) -> None:
    vm_id = api.post("/v1/runtime/schedule", json={"limits": {"vcpus": 1}}).json()["vmId"]
    root = Path("/sys/fs/cgroup")
    try:
        vm_dir = vm_dir_of(pal_server.data_dir, vm_id)
        (pid,) = qemu_pids_under(vm_dir)
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        groups = {ctrls: path for _, ctrls, path in (line.split(":", 2) for line in lines)}
        if (root / "cgroup.controllers").exists():  # cgroup v2
            dirs = {"memory": root / groups[""].lstrip("/"), "cpu": root / groups[""].lstrip("/")}
            limit = int((dirs["memory"] / "memory.max").read_text())
            quota = int((dirs["cpu"] / "cpu.max").read_text().split()[0])
        else:
            dirs = {c: root / c / groups[c].lstrip("/") for c in ("memory", "cpu")}
            limit = int((dirs["memory"] / "memory.limit_in_bytes").read_text())
            quota = int((dirs["cpu"] / "cpu.cfs_quota_us").read_text())
        # Named by the VM's slot (its host resources' name: pal/manager/slots.py).
        assert all(str(d).endswith(f"/pal/{vm_dir.name}") for d in dirs.values()), dirs
        assert limit == (256 + 384) * 1024 * 1024, "guest RAM + QEMU overhead"
        assert quota == 150_000, "1 vCPU + half a core for QEMU's own threads"
    finally:
        api.delete(f"/v1/runtime/vms/{vm_id}")
    assert not any(d.exists() for d in dirs.values()), "the VM's cgroups are removed with it"


def test_a_vms_disk_is_bounded_and_its_limits_are_listed(api: httpx.Client) -> None:
    """limits.disk* hold in the guest (QEMU's throttle, whatever the host's kernel has), and
    the VM lists which host limits held for it and why any did not (here: no BFQ)."""
    spec = {"limits": {"diskWriteMibps": 4, "diskIops": 500}}
    vm = api.post("/v1/runtime/schedule", json=spec).json()
    vm_id = vm["vmId"]
    try:
        assert vm["limits"]["diskWriteMibps"] == 4 and vm["limits"]["diskReadMibps"] == 200, "default"
        got = api.get(f"/v1/runtime/vms/{vm_id}").json()["limitsApplied"]
        assert got["applied"]["diskQemu"] == "read 200 MiB/s, write 4 MiB/s, 500 IOPS"
        assert {"cpu", "memory", "pids"} <= set(got["applied"])
        for limit in ("ioWeight", "diskKernel"):  # each either held or said why not
            assert (limit in got["applied"]) != (limit in got["skipped"]), got
        events = api.get(f"/v1/runtime/vms/{vm_id}/events").json()["events"]
        came_up = [e for e in events if e["toState"] == "running"]
        assert came_up[-1]["details"]["limitsApplied"] == got, "the status event lists them too"
        # 16 MiB of direct writes at 4 MiB/s take 4 s by the guest's clock, less a burst
        # of a tenth of a second's worth: never faster, however idle the host.
        line = "dd if=/dev/zero of=/workspace/bound bs=1M count=16 oflag=direct 2>&1 | tail -1"
        out = api.post(
            f"/v1/runtime/vms/{vm_id}/exec", json={"command": "/bin/sh", "argv": ["-c", line]}
        ).json()
        secs = float(out["stdout"].split(" copied, ")[1].split(" s")[0])
        assert secs >= 16 / 4 * 0.9, out["stdout"]
    finally:
        api.delete(f"/v1/runtime/vms/{vm_id}")
