"""Adoption after a crash or restart of the manager: the QEMUs a previous manager of this
data dir left running are taken over from their state files (vm.VmRegistry.write_state),
so a restart of the control plane never kills the sandboxes.

- The guest's answer is awaited in CPU time, not wall time (``ADOPT_HEARTBEAT_S`` of an
  uncontended CPU: pal/vmm/host_cpu.py), as identify does: a guest starved by a loaded
  host is slow, not gone.
- A VM that cannot be adopted is killed, found by what its QEMU's command line names (its
  slot dir), whatever its state file says or lacks (a QEMU started just before the crash has
  none yet); then every QEMU left under this data dir's ``vms/`` that no adopted VM owns is
  killed too. No QEMU is ever left running without an owner.
- The scheduler's reconciliation then settles the VM's state: a VM whose QEMU is gone but
  that has a complete snapshot is paused from it, never failed (pal/scheduler/reconcile.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import BackendError, GuestTimeout
from pal.ids import is_safe_id
from pal.images.paths import ImagePaths, image_for_restore
from pal.manager.channel import HarnessChannel
from pal.manager.fork import ForkMemory
from pal.manager.vm import LivePause, LiveVm, VmRegistry
from pal.manager.vmnet import VmNetworking, wait_rule
from pal.snapshots.layout import SnapshotRef
from pal.spec import WaitPause, egress_from_json
from pal.vmm import cgroups
from pal.vmm.handoff import qemu_opt
from pal.vmm.host_cpu import LoadSampler, Stretch
from pal.vmm.jail import Jail, real_uid
from pal.vmm.qemu import QemuVm, VmSpec
from pal.wire.models import VolumeMount

log = logging.getLogger(__name__)

ADOPT_HEARTBEAT_S = 5.0  # seconds of an uncontended CPU for an adopted guest to heartbeat
STRETCH_SLICE_S = 0.25  # how often that wait looks at the host's load


@dataclass
class AdoptDeps:
    """Exactly what adoption needs of the node."""

    settings: Settings
    accel: str
    registry: VmRegistry
    jail: Jail
    net: VmNetworking
    forks: ForkMemory
    load: LoadSampler  # the guest's answer is awaited in CPU time


class Adopter:
    def __init__(self, deps: AdoptDeps) -> None:
        self.d = deps

    async def adopt_all(self) -> tuple[list[str], list[str]]:
        """At start: the adopted VMs and the leftover QEMUs killed (their dirs removed).
        Each VM dir is a slot (slots.py): an adopted VM holds its slot again; everything
        named by any other slot (its QEMU, cgroup, uid, dir; its namespace at settle) goes."""
        adopted: list[str] = []
        killed: list[str] = []
        root = self.d.settings.vms_dir
        for vm_dir in sorted(root.iterdir()) if root.is_dir() else []:
            try:
                lv = await self._adopt(vm_dir)
            except Exception as exc:
                log.warning("cannot adopt %s: %s", vm_dir.name, exc)
                self.d.jail.release(vm_dir.name)
                lv = None
            if lv is not None:
                self.d.registry.vms[lv.vm_id] = lv
                self.d.registry.slots.assign(lv.vm_id, lv.slot)
                adopted.append(lv.vm_id)
                continue
            if await asyncio.to_thread(_kill_all, _qemus_labelled(f"{vm_dir}/")):
                killed.append(vm_dir.name)
            await self._forget_slot(vm_dir.name)
            shutil.rmtree(vm_dir, ignore_errors=True)
        # Whatever is left under vms/ that nobody adopted (its dir gone, or made meanwhile).
        owned = {lv.qemu.pid for lv in self.d.registry.vms.values()}
        for pid, slot in _qemus_labelled(f"{root}/").items():
            if pid not in owned and await asyncio.to_thread(_kill_all, {pid: slot}):
                log.warning("killed QEMU %d of slot %s: no VM of this node owns it", pid, slot)
                killed.append(slot)
                await self._forget_slot(slot)
        await self.d.forks.adopted(
            lv.mem_snapshot_id for lv in self.d.registry.vms.values() if lv.mem_snapshot_id
        )
        return adopted, killed

    async def _forget_slot(self, slot: str) -> None:
        """Its QEMU is gone: so are its limits (its namespace goes at settle)."""
        if self.d.settings.cgroups and is_safe_id(slot):
            await asyncio.to_thread(cgroups.remove_leftover, slot)

    def _spec(
        self, st: dict[str, Any], vm_dir: Path, image: ImagePaths, run_as: tuple[int, int] | None
    ) -> VmSpec:
        mem_path, mem_share = Path(st["memPath"]), bool(st["memShare"])
        groups: tuple[int, ...] = ()
        if run_as is not None:
            groups = self.d.jail.adopt(vm_dir.name, run_as[0], None if mem_share else mem_path)
        return VmSpec(
            vm_id=st["vmId"],
            slot=vm_dir.name,
            vm_dir=vm_dir,
            image=image,
            vcpus=int(st["vcpus"]),
            memory_mib=int(st["memoryMib"]),
            disk_path=vm_dir / "disk",
            disk_format=st["diskFormat"],
            config_drive=vm_dir / "config.img",
            accel=self.d.accel,
            run_as=run_as,
            groups=groups,
            cgroup_limits=self.d.settings.cgroups,
            balloon=bool(st.get("balloon", False)),  # a QEMU of an older Pal has none
        )

    async def _adopt(self, vm_dir: Path) -> LiveVm | None:
        st = json.loads((vm_dir / "state.json").read_text())
        if st.get("parked") or st.get("pooled") or st.get("prestarted"):
            return None  # a cache: a parked QEMU's snapshot is on disk, a pool refills
        pid = int(st["pid"])
        run_as = tuple(st["runAs"]) if st.get("runAs") else None
        # The dir is the slot (a dir of an older Pal is named by its vm id, its slot then).
        if st.get("slot", st["vmId"]) != vm_dir.name or not is_safe_id(st["vmId"]):
            return None
        if not _is_qemu_of(pid, vm_dir, run_as[0] if run_as else None):
            return None
        image = image_for_restore(self.d.settings, st["image"], st.get("boot"))
        spec = self._spec(st, vm_dir, image, run_as)  # type: ignore[arg-type]
        egress = egress_from_json(st.get("egress", "none"))
        net_limits = dict(st.get("netLimits") or {})
        brokered = self.d.net.open_brokered(st["vmId"], st.get("brokered"), st.get("tenantCa"))
        ns = self.d.net.ns_name(spec.host_id)
        from pal.network import netns

        if not netns.exists(ns):
            raise BackendError(f"VM {spec.vm_id} lost its network namespace {ns}")
        wait = WaitPause.model_validate(st["wait"]) if st.get("wait") else None
        live = LivePause.from_json(st["livePause"]) if st.get("livePause") else None
        if spec.vm_id not in await self.d.net.registered():
            await self.d.net.reregister(
                spec.vm_id, spec.host_id, egress, net_limits, brokered, wait_rule(wait)
            )
        volumes = [VolumeMount.model_validate(v) for v in st.get("volumes") or []]
        if volumes:  # the server this node process starts exports them again
            await self.d.net.export_volumes(spec.vm_id, volumes, image)
        if live is not None:  # it holds already, unless the crash came mid-resume
            await self.d.net.hold(spec.vm_id)
        qemu = await QemuVm.adopt(
            spec,
            pid,
            mem_path=Path(st["memPath"]),
            mem_share=bool(st["memShare"]),
            keep_paused=live is not None,
        )
        channel = HarnessChannel(qemu.agent_socket, spec.vm_id, self.d.settings.slow_reader_secs)
        try:
            await channel.connect(timeout=2)
            if live is None:
                # The harness heartbeats as soon as it sees the new connection (a
                # live-paused one when it runs again: it is silent until then).
                await _heard(channel, qemu, int(st["incarnation"]), Stretch(ADOPT_HEARTBEAT_S, self.d.load))
        except BaseException:
            await channel.close()
            await qemu.kill()
            raise
        mem_ref = None
        if st.get("memRef"):
            av, src, snap = st["memRef"]
            mem_ref = SnapshotRef(av, src, snap, None)
        log.info("adopted VM %s (QEMU pid %d) left by a previous manager", spec.vm_id, pid)
        return LiveVm(
            vm_id=spec.vm_id,
            tenant_id=st["tenantId"],
            qemu=qemu,
            channel=channel,
            image=image,
            incarnation=int(st["incarnation"]),
            token=st["token"],
            env=dict(st.get("env") or {}),
            memory_mib=spec.memory_mib,
            vcpus=spec.vcpus,
            disk_mib=int(st["diskMib"]),
            mem_snapshot_id=mem_ref.snapshot_id if mem_ref else None,
            mem_ref=mem_ref,
            egress=egress,
            net_limits=net_limits,
            mac=str(st.get("mac") or ""),
            brokered=brokered,
            live=live,
            wait=wait,
            live_paused_ms_total=int(st.get("livePausedMs") or 0),
            slot=spec.host_id,
            volumes=volumes,
        )


async def _heard(channel: HarnessChannel, qemu: QemuVm, incarnation: int, budget: Stretch) -> None:
    """Wait until the guest heartbeats as ``incarnation``, for ``budget`` of CPU time."""
    while True:
        if qemu.exited.is_set():
            raise BackendError(f"VM {channel.vm_id}: its QEMU exited during adoption")
        try:
            await channel.wait_heartbeat(incarnation, timeout=STRETCH_SLICE_S)
            return
        except GuestTimeout:
            if budget.expired:
                why = f"harness did not report incarnation {incarnation} in {budget.describe()}"
                raise GuestTimeout(f"VM {channel.vm_id}: {why}") from None


def _qemus_labelled(label: str) -> dict[int, str]:
    """The QEMUs (pid -> slot, from their ``-name``) whose command line names a file under
    ``label`` (a slot dir, or the whole ``vms/``: handoff.py labels every file it passes)."""
    needle = b"opaque=" + qemu_opt(label).encode()  # the label of a path: not any substring
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isascii() or not d.name.isdigit():
            continue
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not args or b"qemu-system" not in args[0] or not any(needle in a for a in args):
            continue
        name = next((a for a in args if a.startswith(b"pal-")), b"")
        found[int(d.name)] = name.split(b",", 1)[0].decode("latin-1", "replace").removeprefix("pal-")
    return found


def _kill_all(pids: dict[int, str]) -> bool:
    """SIGKILL each (and its process group), and reap what can be reaped; True if any."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:  # our children (a previous manager's are init's): reaped, not zombies
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    return bool(pids)


def _is_qemu_of(pid: int, vm_dir: Path, uid: int | None) -> bool:
    """Whether ``pid`` is a live QEMU of the VM of ``vm_dir`` (not a reused pid): its
    command line is named after the VM and labels its files with ``vm_dir``, and it runs
    as the VM's uid (when that is known)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if not args or b"qemu-system" not in args[0]:
        return False
    named = f"pal-{vm_dir.name},".encode()
    labelled = qemu_opt(str(vm_dir) + "/").encode() in b"\0".join(args)
    if not labelled or not any(a.startswith(named) for a in args):
        return False
    return uid is None or real_uid(pid) == uid
