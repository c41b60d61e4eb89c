"""One QEMU microvm process, driven over QMP: cold boot, snapshot, restore, pause, kill.

Memory model (docs/lifecycle.md, "Pause and resume"): guest RAM is a ``memory-backend-file``.
- A booted VM, or one restored with mem_mode "shared", maps its own ``vm_dir/mem``
  ``share=on``; a snapshot then migrates only device state (``x-ignore-shared``) and
  reflinks the RAM file: memory_kind "file".
- A VM restored with mem_mode "private" (a fork child) maps the snapshot's ``mem``
  ``share=off`` (MAP_PRIVATE, copy-on-write): cheap to start, forks share pages through
  the page cache. Its RAM is not in any file of its own, so its snapshots carry RAM in the
  migration stream: memory_kind "stream", no ``mem`` artifact. Restoring a "stream"
  snapshot gives the VM a fresh sparse shared ``vm_dir/mem`` again.

Runstate (:class:`Runstate`): every QemuVm is in exactly one, changed only through
``_set_state`` against one table, and every operation states the runstates it is valid in
(:func:`require`), raising :class:`RunstateError` otherwise, in the style of qemu.qmp's
protocol.py. An exit observed at any moment wins: EXITED is terminal.

No QEMU process outlives its QemuVm: every failed boot/restore kills and reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from pal.errors import InvalidRequest
from pal.guest.protocol import encode_config
from pal.vmm import cgroups, disks, jail
from pal.vmm.cgroups import VmCgroup
from pal.vmm.cmdline import VmSpec, build_argv, seccomp_args
from pal.vmm.disk_limits import DISK_QEMU, DiskLimits
from pal.vmm.errors import RunstateError, VmExited, VmmError
from pal.vmm.handoff import Handoff
from pal.vmm.runstate import NEXT, Runstate, require
from pal.vmm.runstate import Runstate as S
from pal.vmm.versions import qemu_version
from pal.vmm.vmm_meta import MEMORY_FILE, MEMORY_STREAM, VMM_META, SnapshotArtifacts, misfit, read_vmm_meta

QMP_TIMEOUT_S = 5.0
# QEMU's start up to its QMP greeting: seconds on a 2-core host under load with TCG (a
# cluster test saw more than 5 s while three nodes booted VMs). A QEMU that exits ends the
# wait at once, so a long bound costs nothing when the start fails.
QMP_GREETING_TIMEOUT_S = 30.0
MIGRATE_TIMEOUT_S = 120.0  # a "stream" snapshot moves all guest RAM through a pipe
KILL_GRACE_S = 1.0
MEM_MODES = ("private", "shared")


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


class QemuVm:
    """A QEMU process. Build it with :meth:`boot`, :meth:`restore`, :meth:`spawn_incoming`
    or :meth:`adopt`; :attr:`runstate` says where it is."""

    def __init__(self, spec: VmSpec) -> None:
        self.spec = spec
        self.runstate = S.IDLE
        self.exited = asyncio.Event()  # set together with runstate EXITED
        self.mem_path: Path = spec.mem_path  # the file backing guest RAM
        self.mem_share = True
        self.ignore_shared = True  # x-ignore-shared for the next incoming migration
        self._proc: asyncio.subprocess.Process | None = None
        self._pid: int | None = None  # ours or adopted
        self._watcher: asyncio.Task[None] | None = None
        self._qmp: QMPClient | None = None
        self._log_fd: int | None = None
        self.timings_ms: dict[str, float] = {}
        self._snapshot_dir: Path | None = None  # set by spawn_incoming
        self.cgroup: VmCgroup | None = None  # host limits (cgroups.py)

    # ---------------------------------------------------------------- runstate

    def _set_state(self, new: Runstate) -> None:
        """The one place runstate changes. An exit, once seen, is never overwritten."""
        old = self.runstate
        if old is S.EXITED or new is old:
            return
        if new is S.EXITED:
            self.runstate = new
            self.exited.set()
            return
        if new not in NEXT[old]:
            raise RunstateError(
                f"QEMU of {self.spec.vm_id}: {old.value} -> {new.value} is not a valid change"
            )
        self.runstate = new

    def _check(self, op: str, states: tuple[Runstate, ...]) -> None:
        if self.runstate in states:
            return
        if self.runstate is S.EXITED:
            raise VmExited(f"QEMU of {self.spec.vm_id} has exited; cannot {op}:\n{self.log_tail()}")
        allowed = ", ".join(s.value for s in states)
        raise RunstateError(f"QEMU of {self.spec.vm_id} is {self.runstate.value}; {op} needs {allowed}")

    # ---------------------------------------------------------------- properties

    @property
    def pid(self) -> int | None:
        return self._pid

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
        """A process exists and has not exited (spawned by us or adopted alike)."""
        return self.runstate not in (S.IDLE, S.EXITED)

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
        async with vm._killed_on_failure():
            spec.vm_dir.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(vm._ensure_disk, None)
            vm._new_shared_memory()
            await vm._spawn(incoming=False)
        return vm

    @classmethod
    async def spawn_incoming(
        cls, spec: VmSpec, snapshot_dir: Path, mem_mode: str, mem_file: Path | None = None
    ) -> QemuVm:
        """Start QEMU waiting in ``-incoming defer`` for ``snapshot_dir``; finish with :meth:`load`.
        ``mem_file``: what a private restore maps (default the snapshot's own ``mem``; the
        manager passes a reflinked copy so no QEMU ever maps a snapshot artifact).

        Everything that fixes the command line (memory file, device set) is decided here,
        so a warm pool can run this ahead of time and only pay for :meth:`load` on demand.
        With mem_mode "private" the snapshot's ``mem`` is mapped copy-on-write: the caller
        must have made it openable by ``spec``'s identity (jail.Jail.share).
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
        if meta.get("nic") is None and spec.nic:
            spec = dataclasses.replace(spec, nic=False)  # a snapshot from before VMs had a NIC
        if not meta.get("balloon") and spec.balloon:
            spec = dataclasses.replace(spec, balloon=False)  # from before VMs had a balloon
        vm = cls(spec)
        vm._snapshot_dir = snapshot_dir
        async with vm._killed_on_failure():
            t0 = time.perf_counter()
            await asyncio.to_thread(vm._ensure_disk, snapshot_dir / "rootfs")
            vm.timings_ms["disk"] = _ms(t0)
            t0 = time.perf_counter()
            if meta.get("memoryKind") == MEMORY_STREAM:
                # RAM comes from the stream into a fresh shared file: later snapshots are cheap.
                vm._new_shared_memory()
                vm.ignore_shared = False
            elif mem_mode == "private":
                vm.mem_path, vm.mem_share, vm.ignore_shared = mem_file or snapshot_dir / "mem", False, True
            else:
                await asyncio.to_thread(disks.clone, snapshot_dir / "mem", spec.mem_path, qcow2_ok=False)
                jail.give_to(spec.mem_path, spec.run_as)
                vm.mem_path, vm.mem_share, vm.ignore_shared = spec.mem_path, True, True
            vm.timings_ms["mem"] = _ms(t0)
            t0 = time.perf_counter()
            await vm._spawn(incoming=True)
            vm.timings_ms["spawn"] = _ms(t0)
        return vm

    @classmethod
    async def spawn_waiting(cls, spec: VmSpec, disk_bytes: int) -> QemuVm:
        """Start QEMU in ``-incoming defer`` for a snapshot not chosen yet (pal/manager/prestart.py),
        its disk and shared RAM file sparse placeholders that :meth:`fill` makes a snapshot's
        before :meth:`load`. Success: INCOMING. Failure: the QEMU is killed."""
        vm = cls(spec)
        async with vm._killed_on_failure():
            spec.vm_dir.mkdir(parents=True, exist_ok=True)
            disks.new_sparse_file(spec.disk_path, disk_bytes)
            vm._new_shared_memory()
            await vm._spawn(incoming=True)
        return vm

    @require(S.INCOMING)
    async def fill(self, snapshot_dir: Path) -> None:
        """Make a QEMU of :meth:`spawn_waiting` the snapshot's (it must :func:`misfit` not): its
        disk and RAM file (if a file) reflinked into the placeholders QEMU holds open, the
        same inodes. Then :meth:`load` loads the device state. Failure: killed."""
        try:
            t0 = time.perf_counter()
            meta = await asyncio.to_thread(read_vmm_meta, snapshot_dir)
            why = misfit(meta, self.spec, (snapshot_dir / "rootfs").stat().st_size, self.spec.disk_path)
            if why:
                raise VmmError(f"snapshot {snapshot_dir.name} does not fit QEMU of {self.spec.vm_id}: {why}")
            await asyncio.to_thread(disks.reflink_into, snapshot_dir / "rootfs", self.spec.disk_path)
            if meta.get("memoryKind") == MEMORY_FILE:
                await asyncio.to_thread(disks.reflink_into, snapshot_dir / "mem", self.mem_path)
            self.ignore_shared = meta.get("memoryKind") == MEMORY_FILE  # else RAM is in the stream
            self._snapshot_dir = snapshot_dir
            self.timings_ms = {"fill": _ms(t0)}
        except BaseException:
            await self.kill()
            raise

    @require(S.INCOMING)
    async def load(self) -> None:
        """Load the snapshot given to :meth:`spawn_incoming` and start the guest CPUs.

        Prerequisites: INCOMING. Success: RUNNING. Failure: the QEMU is killed (EXITED).
        """
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
                self._set_state(S.LOADING)
                await self._qmp_call("migrate-incoming", {"uri": "fd:pal-migrate"})
                await self._wait_migration()
            finally:
                os.close(fd)
            self._set_state(S.PAUSED)
            self.timings_ms["load"] = _ms(t0)
            t0 = time.perf_counter()
            await self.cont()  # required: an incoming VM does not start by itself
            self.timings_ms["cont"] = _ms(t0)
        except BaseException:
            await self.kill()
            raise

    @classmethod
    async def restore(
        cls, spec: VmSpec, snapshot_dir: Path, mem_mode: str, mem_file: Path | None = None
    ) -> QemuVm:
        """Start a VM from a snapshot; returns with its CPUs running.

        private: map ``mem_file`` (default the snapshot's mem) MAP_PRIVATE (fork children;
        the file must outlive the VM). shared: reflink it into vm_dir/mem, map share=on
        (resume).
        """
        t0 = time.perf_counter()
        vm = await cls.spawn_incoming(spec, snapshot_dir, mem_mode, mem_file)
        await vm.load()
        vm.timings_ms["total"] = _ms(t0)
        return vm

    @classmethod
    async def adopt(
        cls, spec: VmSpec, pid: int, *, mem_path: Path, mem_share: bool, keep_paused: bool = False
    ) -> QemuVm:
        """Take over a QEMU a previous manager process started (it crashed or restarted).

        The guest CPUs are left running: a capture that was in flight died with the old
        manager, so any outgoing migration is cancelled and a stopped guest continued.
        With ``keep_paused`` (the VM was live-paused) a stopped guest stays stopped.
        Success: RUNNING (PAUSED with ``keep_paused``). Failure: the QEMU is killed.
        """
        vm = cls(spec)
        vm.mem_path, vm.mem_share = mem_path, mem_share
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise VmExited(f"QEMU {pid} of {spec.vm_id} is gone: {exc}") from exc
        vm._pid = pid
        vm._set_state(S.STARTING)
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            vm._set_state(S.EXITED)

        loop.add_reader(pidfd, gone)  # a pidfd turns readable when the process exits
        try:
            if spec.cgroup_limits:  # limits hold for adopted QEMUs too (fail closed)
                vm.cgroup = cgroups.existing_for(spec.host_id) or vm._new_cgroup()
                vm.cgroup.add(pid)
            await vm._connect_qmp()
            status = (await vm._qmp_call("query-status")).get("status")
            if status != "running":
                with contextlib.suppress(VmmError):
                    await vm._qmp_call("migrate_cancel")
                if not keep_paused:
                    await vm._qmp_call("cont")
            elif keep_paused:
                await vm._qmp_call("stop")  # died between its cont and its bookkeeping
            vm._set_state(S.PAUSED if keep_paused else S.RUNNING)
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
        self.spec = dataclasses.replace(spec, disk_format=disks.disk_format_for(method))

    @contextlib.asynccontextmanager
    async def _killed_on_failure(self) -> AsyncIterator[None]:
        """A constructor's steps: whatever fails (or is cancelled) leaves no QEMU behind."""
        try:
            yield
        except BaseException:
            await self.kill()
            raise

    def _new_shared_memory(self) -> None:
        """A fresh sparse RAM file of the VM's size, shared with QEMU (so a snapshot reflinks it)."""
        spec = self.spec
        disks.new_sparse_file(spec.mem_path, spec.memory_mib * 1024 * 1024)
        jail.give_to(spec.mem_path, spec.run_as)
        self.mem_path, self.mem_share = spec.mem_path, True

    @require(S.IDLE)
    async def _spawn(self, *, incoming: bool) -> None:
        """Exec QEMU jailed (jail.py) with what it needs (handoff.py) in its cgroup.

        Prerequisites: IDLE. Success: INCOMING or RUNNING, QMP connected. Failure: raises;
        the caller kills (a process may exist).
        """
        spec = self.spec
        binary = shutil.which(spec.binary) or spec.binary  # resolved here: QEMU gets no PATH search
        if spec.run_as is not None:
            for f in (spec.image.kernel, spec.image.initrd):
                if os.stat(f).st_mode & 0o004 == 0:  # QEMU opens them itself, as its own uid
                    raise VmmError(f"{f} must be readable by every uid (0644) for a jailed QEMU")
        seccomp_args(spec)  # fail closed (503) before anything is made for a QEMU without it
        # Fail closed: the limits exist before QEMU does (503 when they cannot).
        self.cgroup = await asyncio.to_thread(self._new_cgroup) if spec.cgroup_limits else None
        self._log_fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        t0 = time.perf_counter()
        with Handoff() as h:
            argv = build_argv(spec, h, mem_path=self.mem_path, mem_share=self.mem_share, incoming=incoming)
            argv[0] = binary
            os.write(self._log_fd, f"--- {time.strftime('%FT%T')} {shlex.join(argv)}\n".encode())
            try:
                # Own session: kill() signals the whole group.
                self._proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=self._log_fd,
                    stderr=self._log_fd,
                    start_new_session=True,
                    pass_fds=h.pass_fds,
                    **jail.exec_kwargs(spec.run_as, spec.groups, spec.accel, private_ram=not self.mem_share),
                )
            except OSError as exc:
                raise VmmError(f"cannot start {binary}: {exc}") from exc
        self._pid = self._proc.pid
        spec.pid_path.write_text(f"{self._pid}\n")  # for a restarted manager (no -pidfile)
        self._set_state(S.STARTING)
        self._watcher = asyncio.create_task(self._watch(), name=f"qemu-watch-{spec.vm_id}")
        # QEMU is still starting: no guest code has run. Into its cgroup now, or not at all.
        if self.cgroup is not None:
            self.cgroup.add(self._pid)
        await self._connect_qmp()
        self.timings_ms["qmp"] = _ms(t0)
        self._set_state(S.INCOMING if incoming else S.RUNNING)

    def _new_cgroup(self) -> VmCgroup:
        spec = self.spec
        return cgroups.create_for(spec.host_id, spec.vcpus, spec.memory_mib, spec.disk_limits, spec.vm_dir)

    async def limit_disk(self, disk: DiskLimits) -> None:
        """New disk limits for a QEMU that runs already (a claimed pooled VM, a taken
        pre-started QEMU): QEMU's throttle over QMP, then its cgroup's.

        Prerequisites: QMP connected (INCOMING, RUNNING or PAUSED). Success: both layers
        bound the drive by ``disk`` (``limits_report`` says which). Failure: VmmError, the
        previous limits in force.
        """
        self._check("limit_disk", (S.INCOMING, S.RUNNING, S.PAUSED))
        if disk == self.spec.disk_limits:
            return
        await self._qmp_call("block_set_io_throttle", disk.qmp_throttle())
        self.spec = dataclasses.replace(self.spec, disk_limits=disk)
        if self.cgroup is not None:
            await asyncio.to_thread(cgroups.host().limit_disk, self.cgroup, disk, self.spec.vm_dir)

    def limits_report(self) -> tuple[dict[str, str], dict[str, str]]:
        """(applied, skipped): the VM's ``limitsApplied``, its cgroup's and QEMU's own."""
        applied, skipped = cgroups.report(self.cgroup)
        if self.spec.disk_limits:
            applied[DISK_QEMU] = self.spec.disk_limits.describe()
        return applied, skipped

    async def _watch(self) -> None:
        assert self._proc is not None
        await self._proc.wait()
        self._set_state(S.EXITED)

    async def _connect_qmp(self) -> None:
        """Connect to the QMP socket (listening since before the exec) and wait for the
        greeting, or for the process to exit, whichever comes first."""
        # One name for all: qemu.qmp makes a logger per client name, and loggers live forever.
        client = QMPClient("pal")
        connect = asyncio.create_task(client.connect(str(self.spec.qmp_socket)))
        died = asyncio.create_task(self.exited.wait())
        try:
            done, _ = await asyncio.wait(
                {connect, died}, timeout=QMP_GREETING_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            if connect in done and connect.exception() is None:
                self._qmp = client
                return
            why = f"{connect.exception()}" if connect in done else "no greeting"
        finally:
            for t in (connect, died):
                t.cancel()
            await asyncio.gather(connect, died, return_exceptions=True)
        with contextlib.suppress(Exception):
            await client.disconnect()
        if self.exited.is_set():
            raise VmExited(
                f"QEMU for {self.spec.vm_id} exited with code {self.returncode} before QMP came up:\n"
                f"{self.log_tail()}"
            )
        raise VmmError(f"QMP of {self.spec.vm_id} not ready after {QMP_GREETING_TIMEOUT_S:.0f} s ({why})")

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

    @require(S.RUNNING)
    async def pause(self) -> None:
        """Stop the guest CPUs in place (a live pause: QMP ``stop`` also drains and flushes
        the block devices). Prerequisites: RUNNING. Success: PAUSED."""
        await self._qmp_call("stop")
        self._set_state(S.PAUSED)

    @require(S.PAUSED)
    async def cont(self) -> None:
        """Run the stopped guest CPUs. Prerequisites: PAUSED. Success: RUNNING."""
        await self._qmp_call("cont")
        self._set_state(S.RUNNING)

    async def snapshot(self, dest_dir: Path, keep_running: bool) -> SnapshotArtifacts:
        """Capture device state, RAM and disk at one instant into ``dest_dir``.

        With ``keep_running`` the guest continues afterwards; otherwise QEMU is gone.
        On failure the artifacts are removed and the guest runs again (if QEMU lives).
        """
        art = await self.capture(dest_dir)
        t0 = time.perf_counter()
        if keep_running:
            try:
                await self.cont()
            except BaseException:
                await self.kill()
                raise
            art.durations_ms["cont"] = _ms(t0)
        else:
            await self.kill()
            art.durations_ms["quit"] = _ms(t0)
        art.durations_ms["total"] = round(sum(art.durations_ms.values()), 2)
        return art

    @require(S.RUNNING, S.PAUSED)
    async def capture(self, dest_dir: Path) -> SnapshotArtifacts:
        """Stop the guest (unless live-paused already) and capture it into ``dest_dir``.

        Prerequisites: RUNNING or PAUSED. Success: PAUSED (the caller decides what follows: ``cont``,
        or ``kill`` once the capture is safely committed). Failure: the artifacts are
        removed and the guest runs again (RUNNING), or the QEMU is gone (EXITED).
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
            self._set_state(S.PAUSED)
            dur["stop"] = _ms(t0)
            t0 = time.perf_counter()
            self._set_state(S.CAPTURING)
            # x-ignore-shared skips share=on file-backed RAM; for private RAM it must be
            # off anyway so restore knows to expect RAM in the stream.
            await self._set_ignore_shared(kind == MEMORY_FILE)
            # The guest is stopped: its RAM file and disk no longer change, so their
            # reflinks run while QEMU writes the device state (the migration reads neither
            # a shared RAM file, skipped by x-ignore-shared, nor the disk).
            files = asyncio.ensure_future(self._capture_files(kind, paths, dur, methods))
            try:
                fd = os.open(paths["snapshot"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    await self._pass_fd("pal-migrate", fd)
                    await self._qmp_call("migrate", {"uri": "fd:pal-migrate"})
                    await self._wait_migration()
                finally:
                    os.close(fd)
                dur["device_state"] = _ms(t0)
            finally:
                await asyncio.wait([files])  # never leave a clone running past a failure
            files.result()
            meta = {
                "memoryKind": kind,
                "memoryMib": self.spec.memory_mib,
                "vcpus": self.spec.vcpus,
                "configDrive": self.spec.config_drive is not None,
                "nic": self.spec.nic,
                "balloon": self.spec.balloon,
                "accel": self.spec.accel,
                "qemuVersion": qemu_version(self.spec.binary),
                "kernel": str(self.spec.image.kernel),
            }
            paths["vmm"].write_text(json.dumps(meta, indent=2))
            self._set_state(S.PAUSED)
        except BaseException:
            for p in paths.values():
                p.unlink(missing_ok=True)
            await self._recover_after_failed_capture()
            raise
        sizes = {name: p.stat().st_size for name, p in paths.items()}
        return SnapshotArtifacts(dest, paths, sizes, kind, methods, dur, meta)

    async def _capture_files(
        self, kind: str, paths: dict[str, Path], dur: dict[str, float], methods: dict[str, str]
    ) -> None:
        """Reflink the RAM file (a shared-memory VM) and capture the disk, side by side."""

        async def mem() -> None:
            if kind != MEMORY_FILE:
                return
            t0 = time.perf_counter()
            methods["mem"] = await asyncio.to_thread(disks.clone, self.mem_path, paths["mem"], qcow2_ok=False)
            os.chmod(paths["mem"], 0o600)  # the clone of the VM's own file: root's again
            dur["mem_clone"] = _ms(t0)

        async def disk() -> None:
            t0 = time.perf_counter()
            methods["rootfs"] = await asyncio.to_thread(
                disks.capture_raw, self.spec.disk_path, self.spec.disk_format, paths["rootfs"]
            )
            dur["disk_clone"] = _ms(t0)

        got = await asyncio.gather(mem(), disk(), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g

    async def _recover_after_failed_capture(self) -> None:
        """Rollback in one place: the guest runs again, or the QEMU is killed."""
        if self.runstate not in (S.PAUSED, S.CAPTURING):
            return  # RUNNING: `stop` itself failed; EXITED: nothing to recover
        try:
            with contextlib.suppress(VmmError):
                await self._qmp_call("migrate_cancel")
            self._set_state(S.PAUSED)
            await self.cont()
        except BaseException:
            await self.kill()

    async def kill(self) -> None:
        """QMP quit, then SIGKILL to the process group; always reaps. Idempotent.

        Valid in every runstate; afterwards EXITED (IDLE stays IDLE: there is no process).
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
        if self.cgroup is not None and (self.exited.is_set() or pid is None):
            cgroup, self.cgroup = self.cgroup, None
            await asyncio.to_thread(cgroup.remove)
