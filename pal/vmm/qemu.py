"""One QEMU microvm process, driven over QMP: cold boot, snapshot, restore, pause, kill.

Memory model (see DESIGN.md): guest RAM is a ``memory-backend-file``.
- A booted VM, or one restored with mem_mode "shared", maps its own ``vm_dir/mem``
  ``share=on``; a snapshot then migrates only device state (``x-ignore-shared``) and
  reflinks the RAM file: memory_kind "file".
- A VM restored with mem_mode "private" (a fork child) maps the snapshot's ``mem``
  ``share=off`` (MAP_PRIVATE, copy-on-write): cheap to start, forks share pages through
  the page cache. Its RAM is not in any file of its own, so its snapshots carry RAM in the
  migration stream: memory_kind "stream", no ``mem`` artifact. Restoring a "stream"
  snapshot gives the VM a fresh sparse shared ``vm_dir/mem`` again.

No QEMU process outlives its QemuVm: every failed boot/restore kills and reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from pal.errors import InvalidRequest
from pal.guest.protocol import encode_config
from pal.vmm import disks
from pal.vmm.cgroups import VmCgroup
from pal.vmm.cmdline import VmSpec, build_argv
from pal.vmm.errors import VmExited, VmmError
from pal.vmm.versions import qemu_version

QMP_TIMEOUT_S = 5.0
MIGRATE_TIMEOUT_S = 120.0  # a "stream" snapshot moves all guest RAM through a pipe
KILL_GRACE_S = 1.0
MEM_MODES = ("private", "shared")
MEMORY_FILE = "file"
MEMORY_STREAM = "stream"
VMM_META = "vmm.json"  # written next to the artifacts: what restore needs to rebuild the machine


@dataclass
class SnapshotArtifacts:
    dir: Path
    paths: dict[str, Path]  # "snapshot", "rootfs", "vmm", and "mem" when memory_kind == "file"
    sizes: dict[str, int]  # apparent sizes in bytes
    memory_kind: str  # "file" | "stream"
    methods: dict[str, str]  # how each file was captured: reflink | copy | convert
    durations_ms: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # contents of vmm.json


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


def read_vmm_meta(snapshot_dir: Path) -> dict[str, Any]:
    """vmm.json of a snapshot (inferred for a snapshot without one)."""
    path = Path(snapshot_dir) / VMM_META
    if path.exists():
        try:
            meta = json.loads(path.read_text())
        except ValueError as exc:
            raise VmmError(f"corrupt {path}: {exc}") from exc
        if isinstance(meta, dict):
            return meta
    if not (Path(snapshot_dir) / "snapshot").exists():
        raise VmmError(f"{snapshot_dir} holds no snapshot (no device state file)")
    kind = MEMORY_FILE if (Path(snapshot_dir) / "mem").exists() else MEMORY_STREAM
    return {"memoryKind": kind}


class QemuVm:
    """A QEMU process. Build it with :meth:`boot`, :meth:`restore` or :meth:`spawn_incoming`."""

    def __init__(self, spec: VmSpec) -> None:
        self.spec = spec
        self.exited = asyncio.Event()
        self.mem_path: Path = spec.mem_path  # the file backing guest RAM
        self.mem_share = True
        self.ignore_shared = True  # x-ignore-shared for the next incoming migration
        self._proc: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._qmp: QMPClient | None = None
        self._log_fd: int | None = None
        self.timings_ms: dict[str, float] = {}
        self.disk_clone_method: str | None = None  # set when QemuVm cloned the disk itself
        self.mem_clone_method: str | None = None  # set by a "shared" restore
        self._snapshot_dir: Path | None = None  # set by spawn_incoming
        self._adopted_pid: int | None = None  # set by adopt(): a QEMU we did not start
        self.cgroup: VmCgroup | None = None  # host CPU/memory limits (best effort)

    # ---------------------------------------------------------------- properties

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else self._adopted_pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    @property
    def agent_socket(self) -> Path:
        return self.spec.agent_socket

    @property
    def qmp_socket(self) -> Path:
        return self.spec.qmp_socket

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self.exited.is_set()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    # ---------------------------------------------------------------- constructors

    @classmethod
    async def boot(cls, spec: VmSpec) -> QemuVm:
        """Cold boot; returns once QMP answers (the guest is still booting)."""
        vm = cls(spec)
        try:
            spec.vm_dir.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(vm._ensure_disk, None)
            disks.new_sparse_file(spec.mem_path, spec.memory_mib * 1024 * 1024)
            vm.mem_path, vm.mem_share = spec.mem_path, True
            await vm._spawn(incoming=False)
        except BaseException:
            await vm.kill()
            raise
        return vm

    @classmethod
    async def spawn_incoming(cls, spec: VmSpec, snapshot_dir: Path, mem_mode: str) -> QemuVm:
        """Start QEMU waiting in ``-incoming defer`` for ``snapshot_dir``; finish with :meth:`load`.

        Everything that fixes the command line (memory file, device set) is decided here,
        so a warm pool can run this ahead of time and only pay for :meth:`load` on demand.
        """
        if mem_mode not in MEM_MODES:
            raise InvalidRequest(f"mem_mode must be one of {MEM_MODES}, got {mem_mode!r}")
        snapshot_dir = Path(snapshot_dir)
        meta = read_vmm_meta(snapshot_dir)
        snap_mib = meta.get("memoryMib")
        if snap_mib is not None and int(snap_mib) != spec.memory_mib:
            raise InvalidRequest(
                f"snapshot has {snap_mib} MiB of RAM, the VM spec asks for {spec.memory_mib} MiB"
            )
        spec.vm_dir.mkdir(parents=True, exist_ok=True)
        # The machine must match the snapshotted one device for device: a config drive
        # exists iff it existed then (its content is stale anyway; `identify` replaces it).
        had_cfg = meta.get("configDrive")
        if had_cfg is True and spec.config_drive is None:
            cfg = spec.vm_dir / "config.img"
            cfg.write_bytes(encode_config({}))
            spec = dataclasses.replace(spec, config_drive=cfg)
        elif had_cfg is False and spec.config_drive is not None:
            spec = dataclasses.replace(spec, config_drive=None)
        vm = cls(spec)
        vm._snapshot_dir = snapshot_dir
        try:
            t0 = time.perf_counter()
            await asyncio.to_thread(vm._ensure_disk, snapshot_dir / "rootfs")
            vm.timings_ms["disk"] = _ms(t0)
            t0 = time.perf_counter()
            size = spec.memory_mib * 1024 * 1024
            if meta.get("memoryKind") == MEMORY_STREAM:
                # RAM comes from the stream into a fresh shared file: later snapshots of
                # this VM are cheap again.
                disks.new_sparse_file(spec.mem_path, size)
                vm.mem_path, vm.mem_share, vm.ignore_shared = spec.mem_path, True, False
            elif mem_mode == "private":
                vm.mem_path, vm.mem_share, vm.ignore_shared = snapshot_dir / "mem", False, True
            else:
                vm.mem_clone_method = await asyncio.to_thread(
                    disks.clone, snapshot_dir / "mem", spec.mem_path, qcow2_ok=False
                )
                vm.mem_path, vm.mem_share, vm.ignore_shared = spec.mem_path, True, True
            vm.timings_ms["mem"] = _ms(t0)
            t0 = time.perf_counter()
            await vm._spawn(incoming=True)
            vm.timings_ms["spawn"] = _ms(t0)
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def load(self) -> None:
        """Load the snapshot given to :meth:`spawn_incoming` and start the guest CPUs."""
        if self._snapshot_dir is None:
            raise VmmError("load() needs a QemuVm made by spawn_incoming()")
        snapshot = self._snapshot_dir / "snapshot"
        try:
            t0 = time.perf_counter()
            await self._set_ignore_shared(self.ignore_shared)
            # We open the file and hand QEMU the descriptor: QEMU runs as an unprivileged
            # uid that cannot open snapshot files itself, and needs no shell to read one.
            fd = os.open(snapshot, os.O_RDONLY | os.O_CLOEXEC)
            try:
                await self._pass_fd("pal-migrate", fd)
                await self._qmp_call("migrate-incoming", {"uri": "fd:pal-migrate"})
                await self._wait_migration()
            finally:
                os.close(fd)
            self.timings_ms["load"] = _ms(t0)
            t0 = time.perf_counter()
            await self._qmp_call("cont")  # required: an incoming VM does not start by itself
            self.timings_ms["cont"] = _ms(t0)
        except BaseException:
            await self.kill()
            raise

    @classmethod
    async def restore(cls, spec: VmSpec, snapshot_dir: Path, mem_mode: str) -> QemuVm:
        """Start a VM from a snapshot; returns with its CPUs running.

        private: map the snapshot's mem MAP_PRIVATE (fork children; the snapshot must
        outlive the VM). shared: reflink it into vm_dir/mem, map share=on (resume).
        """
        t0 = time.perf_counter()
        vm = await cls.spawn_incoming(spec, snapshot_dir, mem_mode)
        await vm.load()
        vm.timings_ms["total"] = _ms(t0)
        return vm

    @classmethod
    async def adopt(cls, spec: VmSpec, pid: int, *, mem_path: Path, mem_share: bool) -> QemuVm:
        """Take over a QEMU a previous manager process started (it crashed or restarted).

        The guest CPUs are left running: a capture that was in flight died with the old
        manager, so any outgoing migration is cancelled and a stopped guest continued.
        """
        vm = cls(spec)
        vm.mem_path, vm.mem_share = mem_path, mem_share
        vm._adopted_pid = pid
        vm.cgroup = VmCgroup.existing(spec.vm_id)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise VmExited(f"QEMU {pid} of {spec.vm_id} is gone: {exc}") from exc
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            vm.exited.set()

        loop.add_reader(pidfd, gone)  # a pidfd turns readable when the process exits
        try:
            await vm._connect_qmp()
            status = (await vm._qmp_call("query-status")).get("status")
            if status != "running":
                with contextlib.suppress(VmmError):
                    await vm._qmp_call("migrate_cancel")
                await vm._qmp_call("cont")
        except BaseException:
            await vm.kill()
            raise
        return vm

    # ---------------------------------------------------------------- process

    def _ensure_disk(self, source: Path | None) -> None:
        """Clone the per-VM disk from ``source`` (or the image's rootfs) unless it exists."""
        spec = self.spec
        if spec.disk_path.exists():
            return
        src = source if source is not None else spec.image.rootfs
        method = disks.clone(src, spec.disk_path)
        self.spec = spec = dataclasses.replace(spec, disk_format=disks.disk_format_for(method))
        self.disk_clone_method = method

    async def _spawn(self, *, incoming: bool) -> None:
        spec = self.spec
        if spec.run_as is not None:
            # QEMU re-opens its disk when an incoming VM starts, by then as its own uid:
            # the VM's private disk must be its own. (Snapshots and images stay root's.)
            os.chown(spec.disk_path, *spec.run_as)
        for p in (spec.qmp_socket, spec.agent_socket, spec.pid_path):
            p.unlink(missing_ok=True)
        argv = build_argv(spec, mem_path=self.mem_path, mem_share=self.mem_share, incoming=incoming)
        self._log_fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        os.write(self._log_fd, f"--- {time.strftime('%FT%T')} {shlex.join(argv)}\n".encode())
        t0 = time.perf_counter()
        try:
            # Own session: kill() signals the whole group, including `migrate exec:` helpers.
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=self._log_fd,
                stderr=self._log_fd,
                start_new_session=True,
            )
        except OSError as exc:
            raise VmmError(f"cannot start {argv[0]}: {exc}") from exc
        self._watcher = asyncio.create_task(self._watch(), name=f"qemu-watch-{spec.vm_id}")
        self.cgroup = VmCgroup.create(spec.vm_id, spec.vcpus, spec.memory_mib)
        if self.cgroup is not None:
            self.cgroup.add(self._proc.pid)
        await self._connect_qmp()
        self.timings_ms["qmp"] = _ms(t0)

    async def _watch(self) -> None:
        assert self._proc is not None
        await self._proc.wait()
        self.exited.set()

    async def _connect_qmp(self) -> None:
        deadline = time.monotonic() + QMP_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.exited.is_set():
                raise VmExited(
                    f"QEMU for {self.spec.vm_id} exited with code {self.returncode} before QMP came up:\n"
                    f"{self.log_tail()}"
                )
            if self.spec.qmp_socket.exists():
                client = QMPClient(f"pal-{self.spec.vm_id}")
                try:
                    await asyncio.wait_for(client.connect(str(self.spec.qmp_socket)), timeout=1.0)
                    self._qmp = client
                    return
                except (QMPError, OSError, TimeoutError) as exc:
                    last = exc
                    with contextlib.suppress(Exception):
                        await client.disconnect()
            await asyncio.sleep(0.005)
        raise VmmError(f"QMP socket of {self.spec.vm_id} not ready after {QMP_TIMEOUT_S:.0f} s ({last})")

    async def _qmp_call(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        if self._qmp is None or self.exited.is_set():
            raise VmExited(f"QEMU for {self.spec.vm_id} is not running:\n{self.log_tail()}")
        try:
            return await asyncio.wait_for(self._qmp.execute(cmd, args), timeout=QMP_TIMEOUT_S)
        except (QMPError, OSError, TimeoutError) as exc:
            if self.exited.is_set():
                raise VmExited(
                    f"QEMU for {self.spec.vm_id} exited (code {self.returncode}) during {cmd}:\n"
                    f"{self.log_tail()}"
                ) from exc
            raise VmmError(f"QMP {cmd} failed for {self.spec.vm_id}: {exc}") from exc

    async def _set_ignore_shared(self, on: bool) -> None:
        caps = [{"capability": "x-ignore-shared", "state": on}]
        await self._qmp_call("migrate-set-capabilities", {"capabilities": caps})

    async def _wait_migration(self, timeout_s: float = MIGRATE_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            info = await self._qmp_call("query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                return info
            if status in ("failed", "cancelled"):
                why = info.get("error-desc", "") if isinstance(info, dict) else ""
                raise VmmError(f"migration {status} for {self.spec.vm_id}: {why}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise VmmError(f"migration of {self.spec.vm_id} not done after {timeout_s:.0f} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    # ---------------------------------------------------------------- operations

    async def _pass_fd(self, name: str, fd: int) -> None:
        """Give QEMU an open file descriptor under ``name`` (SCM_RIGHTS + QMP getfd)."""
        if self._qmp is None or self.exited.is_set():
            raise VmExited(f"QEMU for {self.spec.vm_id} is not running")
        self._qmp.send_fd_scm(fd)
        await self._qmp_call("getfd", {"fdname": name})

    async def pause(self) -> None:
        """Stop the guest CPUs (QMP stop: also drains and flushes the block devices)."""
        await self._qmp_call("stop")

    stop_cpus = pause

    async def cont(self) -> None:
        await self._qmp_call("cont")

    async def snapshot(self, dest_dir: Path, keep_running: bool) -> SnapshotArtifacts:
        """Capture device state, RAM and disk at one instant into ``dest_dir``.

        With ``keep_running`` the guest continues afterwards; otherwise QEMU is gone.
        On failure the artifacts are removed and the guest runs again (if QEMU lives).
        """
        art = await self.capture(dest_dir)
        t0 = time.perf_counter()
        if keep_running:
            try:
                await self._qmp_call("cont")
            except BaseException:
                await self.kill()
                raise
            art.durations_ms["cont"] = _ms(t0)
        else:
            await self.kill()
            art.durations_ms["quit"] = _ms(t0)
        art.durations_ms["total"] = round(sum(art.durations_ms.values()), 2)
        return art

    async def capture(self, dest_dir: Path) -> SnapshotArtifacts:
        """Stop the guest and capture it into ``dest_dir``; the guest stays stopped.

        The caller decides what follows (``cont``, or ``kill`` once the capture is safely
        committed). On failure the artifacts are removed and the guest runs again.
        """
        dest = Path(dest_dir)
        os.makedirs(dest, exist_ok=True)
        kind = MEMORY_FILE if self.mem_share else MEMORY_STREAM
        paths = {"snapshot": dest / "snapshot", "rootfs": dest / "rootfs", "vmm": dest / VMM_META}
        if kind == MEMORY_FILE:
            paths["mem"] = dest / "mem"
        dur: dict[str, float] = {}
        methods: dict[str, str] = {}
        try:
            t0 = time.perf_counter()
            await self._qmp_call("stop")
            dur["stop"] = _ms(t0)
            t0 = time.perf_counter()
            # x-ignore-shared skips share=on file-backed RAM; for private RAM it must be
            # off anyway so restore knows to expect RAM in the stream.
            await self._set_ignore_shared(kind == MEMORY_FILE)
            fd = os.open(paths["snapshot"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                await self._pass_fd("pal-migrate", fd)
                await self._qmp_call("migrate", {"uri": "fd:pal-migrate"})
                await self._wait_migration()
            finally:
                os.close(fd)
            dur["device_state"] = _ms(t0)
            if kind == MEMORY_FILE:
                t0 = time.perf_counter()
                mem_dst = paths["mem"]
                methods["mem"] = await asyncio.to_thread(disks.clone, self.mem_path, mem_dst, qcow2_ok=False)
                dur["mem_clone"] = _ms(t0)
            t0 = time.perf_counter()
            methods["rootfs"] = await asyncio.to_thread(
                disks.capture_raw, self.spec.disk_path, self.spec.disk_format, paths["rootfs"]
            )
            dur["disk_clone"] = _ms(t0)
            meta = {
                "memoryKind": kind,
                "memoryMib": self.spec.memory_mib,
                "vcpus": self.spec.vcpus,
                "configDrive": self.spec.config_drive is not None,
                "accel": self.spec.accel,
                "qemuVersion": qemu_version(self.spec.binary),
                "kernel": str(self.spec.image.kernel),
            }
            paths["vmm"].write_text(json.dumps(meta, indent=2))
        except BaseException:
            for p in paths.values():
                p.unlink(missing_ok=True)
            await self._recover_after_failed_snapshot()
            raise
        sizes = {name: p.stat().st_size for name, p in paths.items()}
        return SnapshotArtifacts(dest, paths, sizes, kind, methods, dur, meta)

    async def _recover_after_failed_snapshot(self) -> None:
        if not self.alive:
            return
        try:
            with contextlib.suppress(VmmError):
                await self._qmp_call("migrate_cancel")
            await self._qmp_call("cont")
        except BaseException:
            await self.kill()

    async def kill(self) -> None:
        """QMP quit, then SIGKILL to the process group; always reaps. Idempotent.

        Works the same for an adopted QEMU (not our child: its exit is seen via a pidfd).
        """
        pid = self.pid
        if pid is not None and not self.exited.is_set():
            if self._qmp is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._qmp.execute("quit"), timeout=0.5)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.exited.wait(), timeout=KILL_GRACE_S)
            if not self.exited.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # QEMU leads its own session/group
                await self.exited.wait()
        if self._watcher is not None:
            await self._watcher
            self._watcher = None
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None
        if self.cgroup is not None and self.exited.is_set():
            cgroup, self.cgroup = self.cgroup, None
            await asyncio.to_thread(cgroup.remove)
