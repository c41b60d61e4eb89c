"""Issue 9 items 0-2: the whole lifecycle in a data dir where users make one (``mktemp -d``,
0700), with each QEMU jailed, the data dir closed to other local users, and the manager's
socket answering only root.

One `pal up` of its own (nothing shared with other runs) serves the whole module.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pal.images import sample
from pal.vmm.datadir import xfs_image_path
from pal.vmm.jail import GROUP_BASE, GROUP_COUNT, UID_BASE
from tests.conftest import (
    TEST_DATA_DIR,
    PalServer,
    pal_cli,
    private_data_dir,
    qemu_pids_under,
    start_server,
    stop_server,
    wait_template,
)
from tests.leaks import vm_dir_of

pytestmark = pytest.mark.vm

NOBODY = 65534


@pytest.fixture(scope="module")
def private_server() -> Iterator[PalServer]:
    with private_data_dir() as data:
        assert stat.S_IMODE(data.parent.stat().st_mode) == 0o700
        server = start_server(data, share_cache=False)
        try:
            yield server
        finally:
            stop_server(server)


@pytest.fixture(scope="module")
def pc(private_server: PalServer) -> Iterator[httpx.Client]:
    key = private_server.tenant("jail", max_vms=10)
    wait_template(private_server, key)  # builds this data dir's own warm template
    with private_server.client(key) as c:
        yield c


def run(c: httpx.Client, vm: str, script: str) -> str:
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", script]})
    assert r.status_code == 200, r.text
    assert r.json()["exitCode"] == 0, r.json()
    return str(r.json()["stdout"])


def wait_state(c: httpx.Client, vm: str, state: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.get(f"/v1/runtime/vms/{vm}").json()["state"] == state:
            return
        time.sleep(0.2)
    raise AssertionError(f"{vm} never became {state}: {c.get(f'/v1/runtime/vms/{vm}').json()}")


def test_ready_only_once_the_default_template_is_warm(private_server: PalServer) -> None:
    # First in this module: the data dir is new, so its template is still being built.
    # /healthz (alive) answers at once; /readyz waits for the template.
    assert httpx.get(private_server.url + "/healthz", timeout=10).status_code == 200
    first = httpx.get(private_server.url + "/readyz", timeout=10)
    assert first.status_code == 503 and first.json() == {"ready": False}
    deadline = time.monotonic() + 600
    while httpx.get(private_server.url + "/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, private_server.log_tail()
        time.sleep(0.2)
    # `pal up` says so, and the first schedule after it restores the template.
    while "Pal is ready: the default template is warm" not in private_server.log_path.read_text():
        assert time.monotonic() < deadline, private_server.log_tail()  # logged within a poll
        time.sleep(0.2)
    key = private_server.tenant("ready", max_vms=2)
    with private_server.client(key) as c:
        vm = c.post("/v1/runtime/schedule", json={}).json()
        try:
            assert vm["bootMethod"] == "template", vm
        finally:
            c.delete(f"/v1/runtime/vms/{vm['vmId']}")


def test_whole_lifecycle_in_a_0700_data_dir(pc: httpx.Client) -> None:
    vm = pc.post("/v1/runtime/schedule", json={}).json()["vmId"]
    try:
        run(pc, vm, "echo state > /tmp/mem-only")
        # The image was built under Pal's umask 077; the guest's own files keep guest modes.
        run(pc, vm, "cat /etc/resolv.conf /etc/hosts > /dev/null")  # as the workload user
        r = pc.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "f.txt"}, content=b"kept")
        assert r.status_code == 200, r.text
        r = pc.post(f"/v1/runtime/vms/{vm}/pause")
        assert r.status_code == 200, r.text
        r = pc.post(f"/v1/runtime/vms/{vm}/resume")
        assert r.status_code == 200, r.text
        assert run(pc, vm, "cat /tmp/mem-only /workspace/f.txt") == "state\nkept"
        r = pc.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 2})
        assert r.status_code == 200, r.text
        forks = [f["vmId"] for f in r.json()["forks"]]
        for f in forks:
            assert run(pc, f, "cat /tmp/mem-only") == "state\n"
            pc.delete(f"/v1/runtime/vms/{f}")
        r = pc.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "f.txt"})
        assert r.content == b"kept"
    finally:
        pc.delete(f"/v1/runtime/vms/{vm}")


def test_idle_suspend_and_wake_in_a_0700_data_dir(pc: httpx.Client) -> None:
    vm = pc.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 2}).json()["vmId"]
    try:
        run(pc, vm, "echo before > /tmp/x")
        wait_state(pc, vm, "paused")
        assert run(pc, vm, "cat /tmp/x") == "before\n"  # woken by the exec
    finally:
        pc.delete(f"/v1/runtime/vms/{vm}")


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in lines)}


def test_each_qemu_is_jailed(private_server: PalServer, pc: httpx.Client) -> None:
    vm = pc.post("/v1/runtime/schedule", json={}).json()["vmId"]
    forks = pc.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 2}).json()["forks"]
    ids = [vm, *(f["vmId"] for f in forks)]
    try:
        uids = set()
        for vm_id in ids:
            (pid,) = qemu_pids_under(vm_dir_of(private_server.data_dir, vm_id))
            st = _status(pid)
            uid = {int(x) for x in st["Uid"].split()}
            gid = {int(x) for x in st["Gid"].split()}
            assert len(uid) == 1 and len(gid) == 1 and 0 not in uid | gid, st  # real, effective, saved
            uids |= uid
            assert st["CapEff"] == st["CapPrm"] == "0000000000000000", st
            assert st["Seccomp"] == "2", "QEMU runs under its seccomp filter"
            assert "0" not in st["Groups"].split(), "root's supplementary groups are dropped"
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            names = {e.split(b"=", 1)[0].decode() for e in env if e}
            assert names <= {"PATH", "LANG"}, f"QEMU inherited {names}"
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert "-runas" not in (a.decode() for a in cmd)
            sandbox = cmd[cmd.index(b"-sandbox") + 1].decode()
            assert "elevateprivileges=deny" in sandbox and "spawn=deny" in sandbox, sandbox
        assert len(uids) == len(ids), "each VM has its own uid"
        # fork children share one RAM copy: a group of their own, no one else's
        groups = [
            set(_status(p)["Groups"].split())
            for p in (qemu_pids_under(vm_dir_of(private_server.data_dir, f["vmId"]))[0] for f in forks)
        ]
        assert groups[0] and groups[0] == groups[1], groups
        (src_pid,) = qemu_pids_under(vm_dir_of(private_server.data_dir, vm))
        assert not set(_status(src_pid)["Groups"].split()) & groups[0]
    finally:
        for vm_id in ids:
            pc.delete(f"/v1/runtime/vms/{vm_id}")


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            yield Path(dirpath) / n


# Not secret and read by no one but root: the image (kernel, initrd, base root fs, meta)
# may keep the modes it was built or copied with. server.log is this test harness's.
PUBLIC = ("images", "server.log")


def _loose(data: Path) -> list[str]:
    """Files under the data dir that anyone but root could open, beyond the documented
    exceptions: a live VM's own RAM file (its QEMU's uid, 0600) and the RAM copy that fork
    children map (snapshots/.fork-mem/, root:<their group> 0660, see pal/vmm/jail.py)."""
    loose = []
    for p in _walk(data):
        rel = str(p.relative_to(data))
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode) or rel.split("/")[0] in PUBLIC:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if rel.startswith("vms/") and rel.endswith("/mem") and st.st_uid >= UID_BASE and mode == 0o600:
            continue
        shared = GROUP_BASE <= st.st_gid < GROUP_BASE + GROUP_COUNT
        if rel.startswith("snapshots/.fork-mem/") and st.st_uid == 0 and shared and mode == 0o660:
            continue
        if mode & 0o077 or st.st_uid != 0 or st.st_gid != 0:
            loose.append(f"{rel} {oct(mode)} {st.st_uid}:{st.st_gid}")
    return loose


def test_data_dir_is_root_only_and_other_users_get_nothing(
    private_server: PalServer, pc: httpx.Client
) -> None:
    data = private_server.data_dir
    running = pc.post("/v1/runtime/schedule", json={}).json()["vmId"]
    paused = pc.post("/v1/runtime/schedule", json={}).json()["vmId"]
    try:
        assert pc.post(f"/v1/runtime/vms/{paused}/pause").status_code == 200
        fork = pc.post(f"/v1/runtime/vms/{running}/fork", json={"count": 1}).json()["forks"][0]["vmId"]
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert not _loose(data), "\n".join(_loose(data))
        for name in ("pal.db", "run/manager.sock"):
            assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
        assert stat.S_IMODE((data / "run").stat().st_mode) == 0o700

        # As `nobody`: the manager socket and every file under the data dir stay shut, by
        # the data dir's own modes (its mktemp parent is opened up for the probe).
        paths = [str(p) for p in _walk(data) if not p.is_symlink()]
        image = xfs_image_path(data)  # the loop XFS beside it (when the host's fs cannot reflink)
        if image.exists():
            assert stat.S_IMODE(image.stat().st_mode) == 0o600 and image.stat().st_uid == 0
            paths.append(str(image))
        probe = (
            "import json, os, socket, sys\n"
            "paths = json.load(sys.stdin)\n"
            "opened = []\n"
            "for p in paths:\n"
            "    try:\n"
            "        os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))\n"
            "        opened.append(p)\n"
            "    except OSError:\n"
            "        pass\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "    connected = True\n"
            "except OSError:\n"
            "    connected = False\n"
            "print(json.dumps({'opened': opened, 'connected': connected}))\n"
        )
        data.parent.chmod(0o755)
        try:
            out = subprocess.run(
                [
                    "setpriv",
                    f"--reuid={NOBODY}",
                    f"--regid={NOBODY}",
                    "--clear-groups",
                    "/usr/bin/python3",
                    "-c",
                    probe,
                    str(data / "run" / "manager.sock"),
                ],
                input=json.dumps(paths),
                capture_output=True,
                text=True,
                check=True,
                cwd="/",
            )
        finally:
            data.parent.chmod(0o700)
        res = json.loads(out.stdout)
        assert res == {"opened": [], "connected": False}, res
        pc.delete(f"/v1/runtime/vms/{fork}")
    finally:
        pc.delete(f"/v1/runtime/vms/{running}")
        pc.delete(f"/v1/runtime/vms/{paused}")


def seed_image_cache(data: Path) -> None:
    """What building the default image leaves in a user's data dir (install.sh): the Debian
    base tarball and the guest bundle made from it, so an import need not rebuild them."""
    from pal.config import Settings
    from pal.images.importer import guest_bundle

    bundle = guest_bundle(Settings.from_env(TEST_DATA_DIR))  # built with the session's image
    cache = data / "images" / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    for tarball in bundle.parent.glob("rootfs-*.tar"):
        shutil.copy(tarball, cache / tarball.name)
    shutil.copytree(bundle, cache / bundle.name, symlinks=True, dirs_exist_ok=True)


def test_a_users_own_image_runs_pauses_and_resumes_in_a_0700_data_dir(
    private_server: PalServer, pc: httpx.Client, tmp_path: Path
) -> None:
    """Issue 15 where users run: an image imported with the CLI into this data dir boots
    in its jail and survives a pause (QEMU is handed the image's disk like any other)."""
    data = private_server.data_dir
    seed_image_cache(data)
    tree = sample.busybox_tree(tmp_path / "tree", {"etc/motd": "mine\n"})
    archive = sample.archive(tmp_path, [tree], tmp_path / "mine.tar", {"env": ["FOO=bar"]})
    pal_cli("image", "import", "mine", str(archive), "--data-dir", str(data))
    r = pc.post("/v1/runtime/schedule", json={"image": "mine"})
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        run(pc, vm, "echo state > /tmp/mem-only")
        r = pc.post(f"/v1/runtime/vms/{vm}/pause")
        assert r.status_code == 200, r.text
        r = pc.post(f"/v1/runtime/vms/{vm}/resume")
        assert r.status_code == 200, r.text
        assert run(pc, vm, "cat /etc/motd /tmp/mem-only; echo $FOO; id -un") == "mine\nstate\nbar\npal\n"
    finally:
        pc.delete(f"/v1/runtime/vms/{vm}")
        pal_cli("image", "rm", "mine", "--force", "--data-dir", str(data), check=False)
