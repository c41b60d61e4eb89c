"""Adoption after a crash or restart of the manager: the QEMUs a previous manager of this
data dir left running are taken over from their state files (vm.VmRegistry.write_state),
so a restart of the control plane never kills the sandboxes. A VM that cannot be adopted
is killed; the scheduler's reconciliation then settles its state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import BackendError
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
from pal.vmm.jail import Jail, real_uid
from pal.vmm.qemu import QemuVm, VmSpec

log = logging.getLogger(__name__)


@dataclass
class AdoptDeps:
    """Exactly what adoption needs of the node."""

    settings: Settings
    accel: str
    registry: VmRegistry
    jail: Jail
    net: VmNetworking
    forks: ForkMemory


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
            if _kill_leftover(vm_dir):
                killed.append(vm_dir.name)
            if self.d.settings.cgroups and is_safe_id(vm_dir.name):  # its QEMU is gone: so are its limits
                await asyncio.to_thread(cgroups.remove_leftover, vm_dir.name)
            shutil.rmtree(vm_dir, ignore_errors=True)
        await self.d.forks.adopted(
            lv.mem_snapshot_id for lv in self.d.registry.vms.values() if lv.mem_snapshot_id
        )
        return adopted, killed

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
        if live is not None:  # it holds already, unless the crash came mid-resume
            await self.d.net.hold(spec.vm_id)
        qemu = await QemuVm.adopt(
            spec,
            pid,
            mem_path=Path(st["memPath"]),
            mem_share=bool(st["memShare"]),
            keep_paused=live is not None,
        )
        channel = await _reconnect(qemu, spec.vm_id, int(st["incarnation"]), paused=live is not None)
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
        )


async def _reconnect(qemu: QemuVm, vm_id: str, incarnation: int, *, paused: bool) -> HarnessChannel:
    """The adopted guest's channel, heard from (a live-paused one is not: it is silent)."""
    channel = HarnessChannel(qemu.agent_socket, vm_id)
    try:
        await channel.connect(timeout=2)
        if not paused:
            # The harness heartbeats as soon as it sees the new connection (a
            # live-paused one when it runs again).
            await channel.wait_heartbeat(incarnation, timeout=5)
    except BaseException:
        await channel.close()
        await qemu.kill()
        raise
    return channel


def _kill_leftover(vm_dir: Path) -> bool:
    with contextlib.suppress(OSError, ValueError):
        pid = int((vm_dir / "qemu.pid").read_text().strip())
        if _is_qemu_of(pid, vm_dir, None):
            os.killpg(pid, 9)
            return True
    return False


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
