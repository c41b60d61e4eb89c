"""Pre-started restores: QEMUs started ahead of time and waiting for an incoming migration
(``-incoming defer``), for a resume into a new QEMU or a fork child of their size to take
instead of starting one (docs/lifecycle.md, "Pre-started QEMUs").

- **Start** (in the background, one at a time, only while no restore waits for CPU): a
  slot (slots.py) gets its uid (jail.py), its network namespace and tap, its cgroup and a
  QEMU of the size's machine (the default image's kernel and initrd, a config drive, a
  NIC) whose disk and shared RAM file are sparse placeholders. Its ``state.json`` says
  ``prestarted``: a restarted manager never adopts it (adopt.py kills it and frees the
  slot). It has run no guest code and holds no tenant's data.
- **Take** (spawn.py, for a restore whose snapshot fits the machine: size, boot files,
  devices, disk size; ``vmm_meta.misfit``): one QEMU is popped from the set in memory, without
  an await between the look and the pop, so no two restores ever take the same one; its
  slot is re-keyed to the restoring VM's id. The spawn then reflinks the snapshot's disk
  and RAM into the placeholders QEMU holds open (``QemuVm.fill``), registers the VM with
  the gateway on fresh sockets, runs ``migrate-incoming`` and ``cont``, and the guest takes
  its identity as after any restore. The spawn's own state file write is the commit:
  until then the file says ``prestarted`` and a crash leaves the restore failed (its
  snapshot intact) and the QEMU killed. A take that fails kills the QEMU (it never goes
  back).
- **Forks**: a QEMU maps its RAM file when it starts, so a pre-started one holds a file of
  its own, into which a take reflinks the snapshot's RAM; a reflink shares disk extents,
  not page cache. So only restores into RAM of their own take one (a resume, the child of
  a fork of one copy, an offloadable child: ``mem_mode`` "shared"); the children of a fork
  of several copies map the snapshot's fork memory privately, one page cache for all
  (spawn.py ``_take_prestarted``; docs/lifecycle.md, "What a copy shares").
- **Cost**: an idle QEMU waiting in ``-incoming defer`` holds its own memory (``status``
  measures its RSS: the guest RAM is a sparse, untouched file) and no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pal import failpoints, sizes
from pal.config import Settings
from pal.guest import protocol as p
from pal.images.paths import ImagePaths, load_image
from pal.manager import admission
from pal.manager.refill import StandingSet
from pal.manager.restore_gate import RestoreGate
from pal.manager.vm import VmRegistry
from pal.manager.vmnet import VmNetworking
from pal.vmm import disks
from pal.vmm.jail import Jail
from pal.vmm.qemu import QemuVm, VmSpec
from pal.vmm.vmm_meta import misfit

log = logging.getLogger(__name__)

PRESTART_IMAGE = "default"  # whose boot files pre-started QEMUs run
PRESTART_ID_PREFIX = "pre-"
MIB = 1 << 20
QEMU_OWN_MIB = 64  # what one idle QEMU may need of the host's memory (it needs less)
CPU_RECHECK_S = 0.5  # a start waits for the restore gate to be idle, looking this often


@dataclass
class Prestarted:
    qemu: QemuVm
    prestart_id: str
    slot: str
    size: str  # sizes.size_name
    image: ImagePaths  # the boot files it runs
    made_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int | None:
        return self.qemu.pid


@dataclass
class PrestartDeps:
    """Exactly what the set needs of the node."""

    settings: Settings
    accel: str
    registry: VmRegistry
    net: VmNetworking
    jail: Jail
    gate: RestoreGate  # starts wait while restores do (the CPU is theirs)
    free_vm_files: Callable[[str, str], Awaitable[Any]]  # stop.VmFiles.free_vm_files


class PrestartSet(StandingSet[Prestarted]):
    """QEMUs waiting by prestart id (``ready``), kept at PAL_PRESTART's targets."""

    MAKING, TAKEN = "starting", "takes"

    def __init__(self, deps: PrestartDeps) -> None:
        super().__init__(dict(deps.settings.prestart))
        self.d = deps

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        if not any(self.targets.values()) or self._task is not None:
            return
        if not disks.reflink_supported(self.d.settings.data_dir):
            # A take fills the QEMU's open files by reflink; without it there is no take.
            self.last_error = f"{self.d.settings.data_dir} cannot reflink: no pre-started QEMUs"
            log.warning("prestart: %s", self.last_error)
            return
        self._refill_in_background("prestart", self.start_one, before_each=self._cpu_free)

    async def _cpu_free(self) -> None:
        """Starting QEMUs is the CPU budget's last claim: wait while restores run or wait."""
        gate = self.d.gate
        while gate.waiting or gate.in_flight:
            await asyncio.sleep(CPU_RECHECK_S)

    def _spec(self, prestart_id: str, slot: str, image: ImagePaths, size: str, tap_fd: int) -> VmSpec:
        mem, vcpus, _disk = sizes.parse_size_name(size)
        vm_dir = self.d.registry.slot_dir(slot)
        settings = self.d.settings
        return VmSpec(
            vm_id=prestart_id,
            slot=slot,
            vm_dir=vm_dir,
            image=image,
            vcpus=vcpus,
            memory_mib=mem,
            disk_path=vm_dir / "disk",
            config_drive=vm_dir / "config.img",
            accel=self.d.accel,
            run_as=self.d.jail.identity(slot),
            cgroup_limits=settings.cgroups,
            seccomp=settings.seccomp,
            net_fd=tap_fd,
        )

    async def start_one(self, size: str) -> bool:
        """Start one QEMU of ``size`` waiting; False when it could not be started now."""
        disk = sizes.parse_size_name(size)[2]
        prestart_id = PRESTART_ID_PREFIX + secrets.token_hex(6)
        reg = self.d.registry
        slot = reg.slots.assign(prestart_id)
        qemu: QemuVm | None = None
        try:
            await asyncio.to_thread(admission.check_memory, QEMU_OWN_MIB, f"a pre-started QEMU of {size}")
            image = load_image(self.d.settings, PRESTART_IMAGE)
            vnet = await self.d.net.create(slot)
            try:
                spec = self._spec(prestart_id, slot, image, size, vnet.tap_fd)
                spec.vm_dir.mkdir(parents=True, exist_ok=True)
                # The device set of every VM: a config drive (identify replaces what it says).
                (spec.vm_dir / "config.img").write_bytes(p.encode_config({}))
                qemu = await QemuVm.spawn_waiting(spec, disk * MIB)
            finally:
                vnet.close_fds()  # QEMU holds the tap; a take makes new gateway sockets
            failpoints.hit("manager:prestart-spawned")  # waiting, no state file yet
            reg.write_prestarted(slot, prestart_id, qemu.pid or 0)
            failpoints.hit("manager:prestart-ready")  # waiting; its state file says prestarted
            self.ready[prestart_id] = Prestarted(qemu, prestart_id, slot, size, image)
            self.last_error = None
            log.info("prestart: QEMU %s of %s waiting for a restore (%s)", qemu.pid, size, slot)
            return True
        except Exception as exc:
            self.last_error = f"{size}: {exc}"
            log.warning("prestart: a QEMU of %s could not be started: %s", size, exc)
            if qemu is not None:
                await qemu.kill()
            await self.d.free_vm_files(prestart_id, slot)
            return False

    # ------------------------------------------------------------------ take

    def take(
        self, memory_mib: int, vcpus: int, disk_mib: int, image: ImagePaths, meta: dict[str, Any], rootfs: int
    ) -> Prestarted | None:
        """A waiting QEMU the snapshot (``meta``: its vmm.json; ``rootfs``: its disk's size)
        loads into, out of the set, or None. No await between the look and the pop: a QEMU
        is taken by one restore only."""
        size = sizes.size_name(memory_mib, vcpus, disk_mib)
        if size not in self.targets:
            return None
        for pid, q in sorted(self.ready.items(), key=lambda kv: kv[1].made_at):
            if q.size != size or q.qemu.exited.is_set():
                continue
            if (q.image.kernel, q.image.initrd) != (image.kernel, image.initrd):
                continue
            if misfit(meta, q.qemu.spec, rootfs, q.qemu.spec.disk_path) is not None:
                continue
            self.taken += 1
            self._wake.set()  # start another
            return self.ready.pop(pid)
        self.misses += 1
        return None

    # ------------------------------------------------------------------ discard

    async def discard(self, q: Prestarted) -> None:
        await q.qemu.kill()
        await self.d.free_vm_files(q.prestart_id, q.slot)

    async def close(self) -> None:
        """Stop starting and kill every waiting QEMU (the node stops)."""
        ready = await self._stop()
        await asyncio.gather(*(self.discard(q) for q in ready), return_exceptions=True)
