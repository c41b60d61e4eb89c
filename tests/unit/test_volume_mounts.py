"""Volume mounts (docs/volumes.md): the AgentSpec's ``volumes``, ``--volume``, the node's
export config, the guest's parse of identify's ``mounts``, and the node's ganesha itself
(started, reloaded, stopped: a real server, no VM)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import typer
from pydantic import ValidationError

from pal.cli.vm import parse_volume
from pal.guest import volumes as guest_volumes
from pal.manager import volume_quota
from pal.manager.volume_server import VolumeServer, missing_tools
from pal.manager.volumes import VolumeFiles
from pal.network.resvport import unprivileged_low_ports
from pal.spec import AgentSpec
from pal.wire.volumes import VolumeCreate, VolumeRef, VolumeResize

SERVES = os.geteuid() == 0 and not missing_tools() and unprivileged_low_ports() is None


def test_the_spec_takes_absolute_non_system_paths_once_each() -> None:
    spec = AgentSpec.model_validate(
        {
            "volumes": [
                {"name": "cache", "path": "/mnt/cache/"},
                {"name": "vol-1", "path": "/data", "readOnly": True},
            ]
        }
    )
    assert [(m.name, m.path, m.read_only) for m in spec.volumes] == [
        ("cache", "/mnt/cache", False),
        ("vol-1", "/data", True),
    ]
    for bad in (
        [{"name": "a", "path": "/"}],
        [{"name": "a", "path": "/etc"}],
        [{"name": "a", "path": "/usr/local"}],
        [{"name": "a", "path": "/.pal"}],
        [{"name": "a", "path": "data"}],
        [{"name": "a", "path": "/x/../etc"}],
        [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}],
        [{"name": "a", "path": "/x"}, {"name": "b", "path": "/x"}],
        [{"name": "a", "path": "/x"}, {"name": "b", "path": "/x/y"}],
        [{"name": f"v{i}", "path": f"/m{i}"} for i in range(9)],
        [{"name": "a", "path": "/x", "rw": True}],
    ):
        with pytest.raises(ValidationError):
            AgentSpec.model_validate({"volumes": bad})


def test_the_cli_reads_name_path_and_ro() -> None:
    assert parse_volume("cache:/mnt/cache") == {"name": "cache", "path": "/mnt/cache", "readOnly": False}
    assert parse_volume("data:/data:ro") == {"name": "data", "path": "/data", "readOnly": True}
    for bad in ("cache", ":/x", "cache:x"):
        with pytest.raises(typer.BadParameter):
            parse_volume(bad)


def test_the_guest_takes_only_well_formed_mounts() -> None:
    raw = [
        {"export": "vol-abc", "path": "/mnt/a", "ro": True},
        {"export": "vol-abc;rm", "path": "/mnt/b"},
        {"export": "vol-c", "path": "relative"},
        {"export": "vol-d", "path": "/x/../etc"},
        "nonsense",
    ]
    assert guest_volumes.parse(raw) == [("vol-abc", "/mnt/a", True)]
    assert guest_volumes.parse("nope") == []


class _FakeLibc:
    """mount(2) as the guest's harness calls it: records the call, answers ``errno_``
    (0: success), or waits for ``release`` first (a server that never answers)."""

    def __init__(self, errno_: int = 0, release: threading.Event | None = None) -> None:
        self.calls: list[tuple[bytes, bytes, bytes, int, bytes]] = []
        self.errno_, self.release = errno_, release

    def mount(self, source: bytes, target: bytes, fstype: bytes, flags: int, data: bytes) -> int:
        self.calls.append((source, target, fstype, flags, data))
        if self.release is not None:
            self.release.wait()
        ctypes.set_errno(self.errno_)
        return -1 if self.errno_ else 0


def test_the_guest_mounts_by_one_syscall_with_the_nfs_text_options(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeLibc()
    monkeypatch.setattr(guest_volumes.oslib, "libc", lambda: fake)
    guest_volumes.mount_nfs("vol-abc", "/mnt/a", ro=True)
    guest_volumes.mount_nfs("vol-abc", "/mnt/b", ro=False)
    (src, target, fstype, flags, data), rw = fake.calls[0], fake.calls[1]
    assert (src, target, fstype) == (b"10.0.2.2:vol-abc", b"/mnt/a", b"nfs")
    nosuid_nodev = guest_volumes.MS_NOSUID | guest_volumes.MS_NODEV
    assert flags == nosuid_nodev | guest_volumes.MS_RDONLY and rw[3] == nosuid_nodev
    opts = data.decode().split(",")
    # the kernel asks MOUNT itself: the server's address for both, fixed ports, no locks
    for want in ("addr=10.0.2.2", "mountaddr=10.0.2.2", "port=2049", "mountport=20048", "nolock", "hard"):
        assert want in opts, opts


def test_a_refused_or_unanswered_mount_is_an_error_naming_the_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_volumes.oslib, "libc", lambda: _FakeLibc(errno.EACCES))
    with pytest.raises(OSError, match="vol-abc at /mnt/a") as refused:
        guest_volumes.mount_nfs("vol-abc", "/mnt/a", ro=False)
    assert refused.value.errno == errno.EACCES
    release = threading.Event()
    monkeypatch.setattr(guest_volumes.oslib, "libc", lambda: _FakeLibc(release=release))
    try:
        # the harness answers (an error) while the kernel's call still waits for the server
        with pytest.raises(OSError, match="no answer") as hung:
            guest_volumes.mount_nfs("vol-abc", "/mnt/a", ro=False, timeout=0.05)
        assert hung.value.errno == errno.ETIMEDOUT
    finally:
        release.set()


def test_exports_list_each_vm_by_source_with_its_access(tmp_path: Path) -> None:
    server = VolumeServer(tmp_path)
    server.ports = (12049, 12048)
    server.exports = {}
    from pal.manager.volume_server import _Export, _Mount

    server.exports["vol-a"] = _Export(1, tmp_path / "a", {"vm-1": _Mount("127.77.0.1", False, 1000, 1000)})
    server.exports["vol-a"].mounts["vm-2"] = _Mount("127.77.0.2", True, 1000, 1000)
    server.exports["vol-b"] = _Export(2, tmp_path / "b", {})
    conf = server.render()
    a = conf[conf.index("Tag = vol-a") : conf.index("Tag = vol-b")]
    assert "Clients = 127.77.0.1;\n        Access_Type = RW" in a
    assert "Clients = 127.77.0.2;\n        Access_Type = RO" in a
    b = conf[conf.index("Tag = vol-b") :]
    assert "CLIENT" not in b and "Access_Type = None" in b  # nobody mounts it: nobody reaches it
    assert "Bind_addr = 127.0.0.1" in conf and "NFS_Port = 12049" in conf and "Squash = All_Squash" in a


@pytest.mark.skipif(not SERVES, reason="needs root, nfs-ganesha and privileged ports below 1024")
def test_the_node_server_starts_serves_reloads_and_stops(tmp_path: Path) -> None:
    async def run() -> None:
        server = VolumeServer(tmp_path / "run")
        data = tmp_path / "vol" / "data"
        data.mkdir(parents=True)
        try:
            await check(server, data)
        finally:
            await server.stop()

    async def check(server: VolumeServer, data: Path) -> None:
        nfs, mnt = await server.attach("vm-1", "127.77.0.9", [("vol-x", data, False, 7)], 1000, 1000)
        for port in (nfs, mnt):
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        # listening on 127.0.0.1 only (the host's namespace: what the gateway reaches)
        loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, v4 or v4-mapped
        assert _listeners(nfs) and _listeners(nfs) <= loopback and _listeners(mnt) <= loopback
        assert server._proc is not None
        pid = server._proc.pid
        ganesha = server._ganesha_pid()
        assert ganesha is not None
        await server.detach("vm-1")
        assert "127.77.0.9" not in server.conf.read_text()
        assert server.running  # a reload (SIGHUP), not a restart
        assert server._proc.pid == pid
        await server.stop()
        assert not server.running
        for p in (pid, ganesha):  # the whole group: the wrapper, ganesha (and rpcbind)
            for _ in range(200):
                if not Path(f"/proc/{p}").exists() or _zombie(p):
                    break
                await asyncio.sleep(0.02)
            assert not Path(f"/proc/{p}").exists() or _zombie(p)

    asyncio.run(run())


def _listeners(port: int) -> set[str]:
    """The addresses (hex, as /proc/net/tcp has them) listening on ``port``."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.add(addr)
    for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.add(addr)
    return out


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mkfs.xfs") or not shutil.which("xfs_quota"),
    reason="needs root, mkfs.xfs and xfs_quota (a loop XFS with project quotas)",
)
def test_size_is_held_by_an_xfs_project_quota(tmp_path: Path) -> None:
    img, mnt = tmp_path / "xfs.img", tmp_path / "mnt"
    with img.open("wb") as f:
        f.truncate(320 << 20)
    subprocess.run(["mkfs.xfs", "-q", str(img)], check=True)
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-o", "loop,prjquota", str(img), str(mnt)], capture_output=True)
    if mounted.returncode != 0:  # e.g. "XFS: quota support not available in this kernel"
        pytest.skip(f"this kernel cannot mount XFS with project quotas: {mounted.stderr.decode()[:200]}")
    try:
        assert volume_quota.supported(mnt) and not volume_quota.supported(tmp_path)
        files = VolumeFiles(mnt / "volumes")
        asyncio.run(files.create(VolumeCreate(volume_id="vol-q1", tenant_id="t", size_mib=1)))
        asyncio.run(files.create(VolumeCreate(volume_id="vol-q2", tenant_id="t", size_mib=8)))
        data = files.data_dir("vol-q1")
        with pytest.raises(OSError) as err:
            _write_mib(data / "big", 2)
        assert err.value.errno == errno.EDQUOT
        _write_mib(files.data_dir("vol-q2") / "big", 2)  # its own project, its own limit
        asyncio.run(files.resize(VolumeResize(volume_id="vol-q1", size_mib=4)))
        _write_mib(data / "big", 2)
        asyncio.run(files.delete(VolumeRef(volume_id="vol-q1")))
        asyncio.run(files.delete(VolumeRef(volume_id="vol-q2")))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _write_mib(path: Path, mib: int) -> None:
    with path.open("wb") as f:
        for _ in range(mib):
            f.write(b"\0" * (1 << 20))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.skipif(not SERVES, reason="needs root, nfs-ganesha and privileged ports below 1024")
def test_a_local_process_binding_a_vms_address_reaches_nothing(tmp_path: Path) -> None:
    """Any local user may bind 127.77.x.y (loopback needs no privilege); the exports take a
    VM's address only from a port below 1024, which only the gateway (CAP_NET_BIND_SERVICE)
    binds."""
    from tests import nfs_probe

    async def run() -> None:
        server = VolumeServer(tmp_path / "run")
        data = tmp_path / "vol" / "data"
        data.mkdir(parents=True)
        os.chown(data, 1000, 1000)
        try:
            ports = await server.attach("vm-1", "127.77.0.9", [("vol-x", data, False, 7)], 1000, 1000)
            await asyncio.to_thread(check, ports)
        finally:
            await server.stop()

    def check(ports: tuple[int, int]) -> None:
        gw = nfs_probe.run("127.77.0.9", ports, "vol-x", as_root=True)
        assert gw["mnt"] == 0 and gw["getattr"] == 0, gw  # the probe itself works
        local = nfs_probe.run("127.77.0.9", ports, "vol-x", as_root=False)
        # MOUNT answers it (ganesha checks the port for NFS calls only), but the handle it
        # gets opens nothing: every NFS call from an unprivileged port is refused
        assert local["getattr"] not in (0, None), local
        # a handle learnt elsewhere (they are not secret) is no key either
        forged = nfs_probe.run("127.77.0.9", ports, "vol-x", as_root=False, fh=gw["fh"])
        assert forged["getattr"] not in (0, None), forged

    asyncio.run(run())


@pytest.mark.skipif(os.geteuid() != 0, reason="binding a port below 1024 needs root")
def test_the_gateway_connects_from_the_vms_address_and_a_reserved_port() -> None:
    from pal.network import resvport

    async def run() -> None:
        seen: list[tuple[str, int]] = []
        all_seen = asyncio.Event()

        async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            seen.append(w.get_extra_info("peername"))
            if len(seen) == 3:
                all_seen.set()
            w.close()

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        socks = [await resvport.open_connection("127.77.0.3", "127.0.0.1", port, 5) for _ in range(3)]
        ports = {s.getsockname()[1] for s in socks}
        assert len(ports) == 3 and all(512 <= p < 1024 for p in ports)  # each its own port
        assert all(s.getsockname()[0] == "127.77.0.3" for s in socks)
        await all_seen.wait()
        for s in socks:
            s.close()
        server.close()
        await server.wait_closed()
        assert {addr for addr, _ in seen} == {"127.77.0.3"}

    asyncio.run(run())


def test_a_shared_volumes_dir_lifts_the_home_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without PAL_VOLUMES_DIR a VM that mounts a volume is placed on the volume's node only,
    and the volume's calls go there (503 once it is lost); with it, anywhere, and a call
    goes to another active node when the volume's own does not serve (docs/volumes.md)."""
    from types import SimpleNamespace

    from pal.config import Settings
    from pal.errors import Unavailable
    from pal.scheduler import nodes as nodes_mod
    from pal.scheduler.spawning import Spawner
    from pal.scheduler.volumes import Volumes
    from pal.store import volumes as volume_rows

    monkeypatch.setattr(volume_rows, "mounts_of", lambda _store, _vm: [("vol-a", "/mnt/a", False, "n1")])
    recs = {
        "n1": SimpleNamespace(node_id="n1", state=nodes_mod.LOST, healthy=False),
        "n2": SimpleNamespace(node_id="n2", state=nodes_mod.ACTIVE, healthy=True),
    }
    nodes = SimpleNamespace(
        nodes=lambda: list(recs.values()),
        state_of=lambda n: recs[n].state,
        silent=lambda _n: False,
        client=lambda n: f"client of {n}",
    )
    vm = SimpleNamespace(vm_id="vm-1")
    vol = SimpleNamespace(node_id="n1", name="work")
    for shared in (False, True):
        settings = Settings(data_dir=tmp_path, volumes_dir=tmp_path / "shared" if shared else None)
        d = SimpleNamespace(settings=settings, store=None, nodes=nodes)
        spawner = object.__new__(Spawner)
        spawner.d = d  # type: ignore[assignment]
        volumes = Volumes(d)  # type: ignore[arg-type]
        if shared:
            assert spawner.off_volume_nodes(vm) == ()  # type: ignore[arg-type]
            assert volumes._node(vol) == "client of n2"  # type: ignore[arg-type,comparison-overlap]
        else:
            assert spawner.off_volume_nodes(vm) == ("n2",)  # type: ignore[arg-type]
            with pytest.raises(Unavailable):
                volumes._node(vol)  # type: ignore[arg-type]
