"""Issue 34, volumes mounted into sandboxes (docs/volumes.md, docs/lifecycle.md "Volumes"):
two sandboxes share one volume read-write (close-to-open), a snapshot pause keeps the
mount and the resume sees the other's writes, a fork child mounts its parent's volumes,
the files are the sandbox default user's, the data outlives every sandbox; another tenant
cannot mount it, and a guest cannot reach an export it does not mount."""

from __future__ import annotations

import os
import re
import signal
import uuid
from pathlib import Path

import httpx
import pytest

from tests import nfs_probe
from tests.conftest import PalServer, scratch_run_dir, start_server, stop_server

pytestmark = pytest.mark.vm

MNT = "/mnt/vol"


def sh(api: httpx.Client, vm: str, line: str) -> dict:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200, r.text
    return r.json()


def ok(api: httpx.Client, vm: str, line: str) -> str:
    out = sh(api, vm, line)
    assert out["exitCode"] == 0, out
    return str(out["stdout"])


def schedule(api: httpx.Client, **spec: object) -> str:
    r = api.post("/v1/runtime/schedule", json=spec)
    assert r.status_code == 200, r.text
    return str(r.json()["vmId"])


def test_two_sandboxes_share_a_volume_across_pause_fork_and_delete(
    pal_server: PalServer, api: httpx.Client
) -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    vol = api.post("/v1/volumes", json={"name": name, "sizeMib": 64}).json()
    vms: list[str] = []
    try:
        mount = [{"name": name, "path": MNT}]
        a = schedule(api, volumes=mount)
        vms.append(a)
        b = schedule(api, volumes=[{"name": vol["volumeId"], "path": MNT}])
        vms.append(b)
        got = api.get(f"/v1/volumes/{name}").json()
        assert sorted(got["mountedBy"]) == sorted([a, b])
        r = api.delete(f"/v1/volumes/{name}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "VOLUME_MOUNTED", r.text

        # close-to-open: what one closed, the other's next open sees
        ok(api, a, f"echo from-a > {MNT}/a.txt")
        assert ok(api, b, f"cat {MNT}/a.txt") == "from-a\n"
        ok(api, b, f"echo from-b >> {MNT}/a.txt && sync")
        assert ok(api, a, f"cat {MNT}/a.txt") == "from-a\nfrom-b\n"
        # the sandbox's default user owns what root and the user write
        uid = ok(api, a, "id -u").strip()
        assert ok(api, a, f"stat -c %u {MNT}/a.txt").strip() == uid
        mounts = ok(api, a, "grep ' nfs ' /proc/mounts")
        assert MNT in mounts and "nosuid" in mounts and "nodev" in mounts, mounts
        # 1 MiB transfers and a readahead of 16 MiB (the client's own default is 128 KiB)
        assert "rsize=1048576" in mounts and "wsize=1048576" in mounts, mounts
        bdi = (
            f"import os; d = os.stat('{MNT}').st_dev; "
            "print(open(f'/sys/class/bdi/{os.major(d)}:{os.minor(d)}/read_ahead_kb').read())"
        )
        assert ok(api, a, f'python3 -c "{bdi}"').strip() == "16384"

        # a snapshot pause keeps the mount; the resume sees what B wrote meanwhile
        r = api.post(f"/v1/runtime/vms/{a}/pause")
        assert r.status_code == 200, r.text
        ok(api, b, f"echo while-paused > {MNT}/b.txt")
        r = api.post(f"/v1/runtime/vms/{a}/resume")
        assert r.status_code == 200, r.text
        assert ok(api, a, f"cat {MNT}/b.txt") == "while-paused\n"
        ok(api, a, f"echo after-resume > {MNT}/c.txt")
        assert ok(api, b, f"cat {MNT}/c.txt") == "after-resume\n"

        # a live pause (memory offloaded) keeps the QEMU and its mount; B writes meanwhile
        r = api.post(f"/v1/runtime/vms/{b}/pause", json={"mode": "live", "offload": True})
        assert r.status_code == 200 and r.json()["pause"]["kind"] == "live", r.text
        ok(api, a, f"echo while-live-paused > {MNT}/e.txt")
        r = api.post(f"/v1/runtime/vms/{b}/resume")
        assert r.status_code == 200, r.text
        assert ok(api, b, f"cat {MNT}/e.txt") == "while-live-paused\n"

        # a fork child mounts what its parent mounts
        r = api.post(f"/v1/runtime/vms/{a}/fork", json={"count": 1})
        assert r.status_code == 200, r.text
        child = r.json()["forks"][0]["vmId"]
        vms.append(child)
        assert ok(api, child, f"cat {MNT}/b.txt") == "while-paused\n"
        # the child kept the mount it came with (no second one stacked on it)
        assert ok(api, child, f"grep -c ' {MNT} nfs ' /proc/mounts").strip() == "1"
        ok(api, child, f"echo from-child > {MNT}/d.txt")
        assert ok(api, b, f"cat {MNT}/d.txt") == "from-child\n"
        assert child in api.get(f"/v1/volumes/{name}").json()["mountedBy"]

        # fsync'd data outlives every sandbox: read back through a new one
        ok(api, a, f"dd if=/dev/urandom of={MNT}/big bs=64k count=16 conv=fsync 2>/dev/null")
        want = ok(api, a, f"md5sum < {MNT}/big")
        for vm in vms:
            assert api.delete(f"/v1/runtime/vms/{vm}").status_code == 200
        vms.clear()
        assert api.get(f"/v1/volumes/{name}").json()["mountedBy"] == []
        reader = schedule(api, volumes=[{"name": name, "path": "/data", "readOnly": True}])
        vms.append(reader)
        assert ok(api, reader, "md5sum < /data/big") == want
        assert ok(api, reader, "cat /data/a.txt /data/d.txt") == "from-a\nfrom-b\nfrom-child\n"
        # read-only is the server's word, not only the guest's mount flag
        assert sh(api, reader, "echo x > /data/x")["exitCode"] != 0
    finally:
        for vm in vms:
            api.delete(f"/v1/runtime/vms/{vm}")
        api.delete(f"/v1/volumes/{name}", params={"force": "true"})


def test_another_tenant_cannot_mount_or_reach_a_volume(pal_server: PalServer, api: httpx.Client) -> None:
    mine, theirs = f"mine-{uuid.uuid4().hex[:8]}", f"theirs-{uuid.uuid4().hex[:8]}"
    other = pal_server.client(pal_server.tenant(f"vol-other-{uuid.uuid4().hex[:6]}", max_vms=2))
    vol = api.post("/v1/volumes", json={"name": mine}).json()
    r = other.post("/v1/volumes", json={"name": theirs})
    assert r.status_code == 200, r.text
    their_id = r.json()["volumeId"]
    vms: list[str] = []
    try:
        # 404 at schedule, by name and by id, exactly as for a missing one
        for ref in (mine, vol["volumeId"], "no-such-volume"):
            r = other.post("/v1/runtime/schedule", json={"volumes": [{"name": ref, "path": MNT}]})
            assert r.status_code == 404, r.text
        bad = api.post("/v1/runtime/schedule", json={"volumes": [{"name": mine, "path": "/etc"}]})
        assert bad.status_code == 400, bad.text
        # from inside a guest: the export of a volume this VM does not mount is refused
        vm = schedule(other, volumes=[{"name": theirs, "path": MNT}])
        vms.append(vm)
        opts = "vers=3,proto=tcp,port=2049,mountport=20048,mountproto=tcp,nolock,soft,timeo=20,retrans=1"
        out = sh(
            other,
            vm,
            f"mkdir -p /mnt/x && /.pal/bin/busybox mount -t nfs -o {opts} 10.0.2.2:{vol['volumeId']} /mnt/x",
        )
        assert out["exitCode"] != 0, out
        assert "denied" in (out["stdout"] + out["stderr"]).lower(), out
        # nor from the host: a local process that binds the VM's source address (no
        # privilege needed) gets no NFS answer; only the gateway's reserved port does
        source, ports = _served(pal_server.data_dir, their_id)
        local = nfs_probe.run(source, ports, their_id, as_root=False)
        assert local["getattr"] not in (0, None), local
        gateway_like = nfs_probe.run(source, ports, their_id, as_root=True)
        assert gateway_like["getattr"] == 0, gateway_like
        forged = nfs_probe.run(source, ports, their_id, as_root=False, fh=gateway_like["fh"])
        assert forged["getattr"] not in (0, None), forged
        assert ok(other, vm, f"ls -a {MNT}")  # the guest's own mount goes on
    finally:
        for v in vms:
            other.delete(f"/v1/runtime/vms/{v}")
        other.delete(f"/v1/volumes/{theirs}", params={"force": "true"})
        api.delete(f"/v1/volumes/{mine}", params={"force": "true"})
        other.close()


def _served(data_dir: Path, volume_id: str) -> tuple[str, tuple[int, int]]:
    """The source address the node's volume server takes for ``volume_id`` and its ports
    (nfs, mount), from the config the node wrote."""
    conf = (data_dir / "run" / "volumes" / "ganesha.conf").read_text()
    nfs = int(re.search(r"NFS_Port = (\d+);", conf)[1])  # type: ignore[index]
    mnt = int(re.search(r"MNT_Port = (\d+);", conf)[1])  # type: ignore[index]
    export = conf[conf.index(f"Tag = {volume_id};") :]
    source = re.search(r"Clients = (127\.77\.\d+\.\d+)", export)[1]  # type: ignore[index]
    return source, (nfs, mnt)


# Appends 4 KiB records to the volume, each fsync'd before its number is recorded on the
# sandbox's own disk: a number there is a write the volume acknowledged.
WRITER = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
i = 0
while True:
    os.write(fd, (b"%08d" % i) * 512)
    os.fsync(fd)
    i += 1
    with open("/workspace/acked.tmp", "w") as f:
        f.write(str(i))
    os.replace("/workspace/acked.tmp", "/workspace/acked")
"""

CHECK = r"""
import sys
data = open(sys.argv[1], "rb").read()
n = len(data) // 4096
good = 0
for i in range(n):
    if data[i * 4096 : (i + 1) * 4096] != (b"%08d" % i) * 512:
        break
    good += 1
print(good)
"""


def _kill_volume_server(run_dir: Path) -> None:
    """Whatever a failed test left of the run's volume server (its process group)."""
    try:
        pid = int((run_dir / "run" / "volumes" / "server.pid").read_text())
        if b"pal-volumes" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.killpg(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_every_fsynced_write_survives_a_server_sigkill_and_the_sandboxes(warm_template: None) -> None:
    with scratch_run_dir("volkill") as run_dir:
        server = start_server(run_dir)
        try:
            key = server.tenant("vol-kill", max_vms=3)
            with server.client(key, timeout=120) as c:
                assert c.post("/v1/volumes", json={"name": "durable"}).status_code == 200
                w = schedule(c, volumes=[{"name": "durable", "path": "/vol"}])
                c.put(f"/v1/runtime/vms/{w}/files/content", params={"path": "writer.py"}, content=WRITER)
                ok(
                    c,
                    w,
                    "setsid python3 writer.py /vol/log >/dev/null 2>&1 & echo $! > /workspace/writer.pid",
                )
                ok(c, w, "while [ $(cat /workspace/acked 2>/dev/null || echo 0) -lt 20 ]; do sleep 0.1; done")
            server.proc.kill()  # kill -9 in the middle of the writes: the VM and its writer live on
            server.proc.wait(60)
            server = start_server(run_dir)
            with server.client(key, timeout=120) as c:
                assert c.get(f"/v1/runtime/vms/{w}").json()["state"] == "running"
                ok(
                    c,
                    w,
                    "P=$(cat /workspace/writer.pid); kill $P; "
                    "while [ -e /proc/$P ] && [ \"$(cut -d' ' -f3 /proc/$P/stat)\" != Z ]; do "
                    "sleep 0.05; done",
                )
                acked = int(ok(c, w, "cat /workspace/acked"))
                assert acked >= 20
                assert c.delete(f"/v1/runtime/vms/{w}").status_code == 200
                r = schedule(c, volumes=[{"name": "durable", "path": "/vol", "readOnly": True}])
                c.put(f"/v1/runtime/vms/{r}/files/content", params={"path": "check.py"}, content=CHECK)
                good = int(ok(c, r, "python3 check.py /vol/log"))
                assert good >= acked, f"{acked} records acknowledged, {good} intact"
                assert c.delete(f"/v1/runtime/vms/{r}").status_code == 200
        finally:
            stop_server(server)
            _kill_volume_server(run_dir)
