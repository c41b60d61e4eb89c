"""Real QEMU microVMs through pal.vmm: cold boot, snapshot, restore (shared, private, stream).

Uses the built `default` image of PAL_TEST_DATA_DIR (kernel and initrd from its boot set)
and talks to the guest harness over the agent socket with pal.guest.protocol. Every test
kills its VMs and checks that no QEMU process is left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import secrets
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from pal.config import Settings
from pal.errors import Unavailable
from pal.guest import protocol as proto
from pal.images.paths import load_image
from pal.vmm import accel, disks
from pal.vmm.cmdline import ImageFiles, VmSpec
from pal.vmm.errors import VmExited, VmmError
from pal.vmm.qemu import QemuVm

pytestmark = pytest.mark.vm

DATA = Path(os.environ.get("PAL_TEST_DATA_DIR", "/var/lib/pal-test"))


@functools.cache
def image_files() -> ImageFiles:
    """The default image's files (fails, never skips, when the image is missing)."""
    img = load_image(Settings.from_env(DATA), "default")
    return ImageFiles(kernel=img.vmlinux, initrd=img.initrd, rootfs=img.rootfs)


GUEST_TIMEOUT_S = 60.0  # TCG cold boot of the Python harness is ~4 s; CI hosts are slower


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Agent:
    """Minimal host side of the harness protocol, enough to identify and exec."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.next_id = 1
        self.token = ""

    @classmethod
    async def connect(cls, sock: Path, vm_id: str, incarnation: int) -> Agent:
        deadline = time.monotonic() + GUEST_TIMEOUT_S
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(sock), limit=proto.MAX_LINE_BYTES)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)
        agent = cls(reader, writer)
        writer.write(b"\n")
        agent.token = secrets.token_hex(8)
        ident = {
            "incarnation": incarnation,
            "token": agent.token,
            "vm_id": vm_id,
            "now_ns": time.time_ns(),
            "seed": secrets.token_hex(32),
            "env": {},
        }
        # The harness may still be booting: resend identify until it answers.
        while True:
            try:
                reply = await agent.request(proto.K_IDENTIFY, ident, wait_s=2.0)
                assert reply[-1]["k"] == proto.K_OK, reply
                return agent
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    async def request(self, kind: str, body: dict[str, Any], wait_s: float = 30.0) -> list[proto.Message]:
        rid = self.next_id
        self.next_id += 1
        self.writer.write(proto.encode({"id": rid, "k": kind, **body}))
        await self.writer.drain()
        got: list[proto.Message] = []
        async with asyncio.timeout(wait_s):
            while True:
                line = await self.reader.readline()
                if not line:
                    raise ConnectionError("agent socket closed")
                msg = proto.decode(line)
                if msg is None or msg.get("id") != rid:
                    continue
                got.append(msg)
                if msg["k"] in (proto.K_OK, proto.K_EXIT, proto.K_ERR):
                    return got

    async def sh(self, script: str) -> str:
        body: dict[str, Any] = {"tok": self.token, "argv": ["/bin/sh", "-c", script], "env": {}, "cwd": None}
        msgs = await self.request(proto.K_EXEC, {**body, "timeout": 20.0, "user": "root"})
        assert msgs[-1]["k"] == proto.K_EXIT and msgs[-1]["code"] == 0, msgs
        return b"".join(proto.payload(m) for m in msgs if m["k"] == proto.K_OUT).decode()

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
def workdir() -> Iterator[Path]:
    image_files()
    d = DATA / "test-vmm" / uuid.uuid4().hex[:8]
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def vms() -> AsyncIterator[list[QemuVm]]:
    """Collects every QemuVm a test makes; kills them all and proves no process is left."""
    made: list[QemuVm] = []
    yield made
    for vm in made:
        await vm.kill()
    for vm in made:
        assert vm.pid is None or not _pid_alive(vm.pid), f"QEMU {vm.pid} still running"


def _spec(workdir: Path, name: str) -> VmSpec:
    """A VM as the server would make it under the suite's settings (PAL_CGROUPS,
    PAL_SECCOMP, the accelerator): these tests build QEMUs without a server."""
    vm_dir = workdir / name
    settings = Settings.from_env(DATA)
    return VmSpec(
        vm_id=name,
        vm_dir=vm_dir,
        image=image_files(),
        vcpus=1,
        memory_mib=256,
        disk_path=vm_dir / "disk",
        accel="kvm" if settings.accel == "kvm" else "tcg",
        cgroup_limits=settings.cgroups,
        seccomp=settings.seccomp,
    )


async def test_cold_boot_exec_and_kill_reaps(workdir: Path, vms: list[QemuVm]) -> None:
    t0 = time.perf_counter()
    vm = await QemuVm.boot(_spec(workdir, "cold"))
    vms.append(vm)
    qmp_ms = (time.perf_counter() - t0) * 1000
    agent = await Agent.connect(vm.agent_socket, "cold", 1)
    ready_ms = (time.perf_counter() - t0) * 1000
    assert (await agent.sh("echo hello; id -u")).split() == ["hello", "0"]
    agent.close()
    print(f"cold boot: QMP {qmp_ms:.0f} ms, harness answering {ready_ms:.0f} ms")
    pid = vm.pid
    assert pid is not None and _pid_alive(pid)
    await vm.kill()
    assert vm.exited.is_set() and not _pid_alive(pid)


def _qemu_without_seccomp(workdir: Path) -> str:
    """The real QEMU, as a build without seccomp shows itself: no -sandbox in its -help."""
    real = shutil.which("qemu-system-x86_64")
    wrapper = workdir / "qemu-without-seccomp"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-help" ]; then "{real}" -help | grep -v -- -sandbox; exit 0; fi\n'
        f'exec "{real}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


async def test_a_qemu_without_seccomp_starts_no_vm_unless_opted_out(workdir: Path, vms: list[QemuVm]) -> None:
    binary = _qemu_without_seccomp(workdir)
    refused = dataclasses.replace(_spec(workdir, "no-seccomp"), binary=binary, seccomp=True)
    with pytest.raises(Unavailable, match="PAL_SECCOMP=off"):
        await QemuVm.boot(refused)
    assert not refused.pid_path.exists() and not refused.log_path.exists()  # no QEMU was started
    opted_out = dataclasses.replace(_spec(workdir, "opted-out"), binary=binary, seccomp=False)
    vm = await QemuVm.boot(opted_out)
    vms.append(vm)
    agent = await Agent.connect(vm.agent_socket, "opted-out", 1)
    assert (await agent.sh("echo up")).strip() == "up"
    agent.close()
    assert vm.pid is not None
    assert b"-sandbox" not in Path(f"/proc/{vm.pid}/cmdline").read_bytes().split(b"\0")
    assert "Seccomp:\t0" in Path(f"/proc/{vm.pid}/status").read_text()
    sandboxed = await QemuVm.boot(dataclasses.replace(_spec(workdir, "sandboxed"), seccomp=True))
    vms.append(sandboxed)
    assert "Seccomp:\t2" in Path(f"/proc/{sandboxed.pid}/status").read_text()


async def test_snapshot_and_restores_keep_memory(workdir: Path, vms: list[QemuVm]) -> None:
    vm = await QemuVm.boot(_spec(workdir, "src"))
    vms.append(vm)
    agent = await Agent.connect(vm.agent_socket, "src", 1)
    marker = uuid.uuid4().hex
    # /tmp is a tmpfs: its content lives only in guest RAM. /workspace is on the disk.
    await agent.sh(f"echo {marker} > /tmp/ram-marker; echo {marker} > /workspace/disk-marker")

    live = await vm.snapshot(workdir / "snap-live", keep_running=True)
    assert live.memory_kind == "file" and set(live.paths) == {"snapshot", "mem", "rootfs", "vmm"}
    assert (await agent.sh("cat /tmp/ram-marker")).strip() == marker  # still running
    await agent.sh("echo after-live > /tmp/ram-marker")
    agent.close()

    snap = await vm.snapshot(workdir / "snap", keep_running=False)
    assert vm.exited.is_set() and vm.pid is not None and not _pid_alive(vm.pid)
    print(f"snapshot: {snap.durations_ms} methods {snap.methods}")

    restored: dict[str, QemuVm] = {}
    for mode in ("shared", "private"):
        r = await QemuVm.restore(_spec(workdir, f"r-{mode}"), snap.dir, mode)
        vms.append(r)
        restored[mode] = r
        print(f"restore {mode}: {r.timings_ms}")
        a = await Agent.connect(r.agent_socket, f"r-{mode}", 2)
        assert (await a.sh("cat /tmp/ram-marker")).strip() == "after-live"
        assert (await a.sh("cat /workspace/disk-marker")).strip() == marker
        a.close()
    # The shared restore owns a RAM file; the private one maps the snapshot's.
    assert restored["shared"].mem_path == workdir / "r-shared" / "mem"
    assert restored["private"].mem_path == snap.dir / "mem"

    # Warm pool: a QEMU pre-spawned in -incoming defer loads the snapshot later on demand.
    pooled = await QemuVm.spawn_incoming(_spec(workdir, "pooled"), snap.dir, "private")
    vms.append(pooled)
    t0 = time.perf_counter()
    await pooled.load()
    print(f"pooled load+cont: {(time.perf_counter() - t0) * 1000:.1f} ms")
    a = await Agent.connect(pooled.agent_socket, "pooled", 2)
    assert (await a.sh("cat /tmp/ram-marker")).strip() == "after-live"
    a.close()
    await pooled.kill()

    # A fork child (private RAM) snapshots RAM into the stream; restoring it works.
    child = await restored["private"].snapshot(workdir / "snap-child", keep_running=False)
    assert child.memory_kind == "stream" and "mem" not in child.paths
    again = await QemuVm.restore(_spec(workdir, "r-stream"), child.dir, "private")
    vms.append(again)
    a = await Agent.connect(again.agent_socket, "r-stream", 3)
    assert (await a.sh("cat /tmp/ram-marker")).strip() == "after-live"
    a.close()
    assert again.mem_share  # RAM is its own file again: its next snapshot is cheap


async def test_failed_boot_leaves_no_qemu(workdir: Path, vms: list[QemuVm]) -> None:
    spec = _spec(workdir, "broken")
    spec.vm_dir.mkdir()
    disks.new_sparse_file(spec.disk_path, 1 << 20)
    files = image_files()
    spec.image = ImageFiles(kernel=workdir / "no-such-vmlinux", initrd=files.initrd, rootfs=files.rootfs)
    with pytest.raises(VmmError, match="no-such-vmlinux"):  # before any exec: files are opened first
        await QemuVm.boot(spec)
    # A process that exits before QMP answers is reaped and reported with its log.
    with pytest.raises(VmExited, match="before QMP came up"):
        # (no seccomp check: `false` has no -sandbox; the filter is not what this tests)
        await QemuVm.boot(dataclasses.replace(_spec(workdir, "exits"), binary="false", seccomp=False))


async def test_exited_event_when_qemu_dies(workdir: Path, vms: list[QemuVm]) -> None:
    vm = await QemuVm.boot(_spec(workdir, "dies"))
    vms.append(vm)
    assert vm.pid is not None
    os.kill(vm.pid, 9)
    await asyncio.wait_for(vm.exited.wait(), 5)
    assert vm.returncode == -9


async def test_accel_probe_answers_with_a_reason(tmp_path: Path) -> None:
    kernel = image_files().kernel
    settings = Settings(data_dir=tmp_path)
    t0 = time.monotonic()
    # a hang guard, not a speed bound: the probe's own timeout is PROBE_TIMEOUT_S
    info = await asyncio.wait_for(asyncio.to_thread(accel.probe, settings, None, kernel), 300)
    assert info.name in ("kvm", "tcg") and info.reason
    print(f"accel: {info.name} ({info.reason}) in {time.monotonic() - t0:.1f} s")
    if accel.KVM_DEVICE.exists():
        # The probe ran (no early exit), so its answer is cached for the next start.
        assert accel.probe(settings).reason.endswith("(cached)")
