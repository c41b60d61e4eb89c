"""The node's VM registry: the live VMs of this host and their state files.

Every other module of the manager reaches a VM through :class:`VmRegistry` (never through
a dict of its own): ``live``/``running`` are the two preconditions of a call on a VM, and
``write_state`` the one writer of the ``state.json`` a restarted manager adopts the VM by
(adopt.py reads it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal.errors import Conflict
from pal.guest import protocol as p
from pal.ids import validate_id
from pal.images.paths import ImagePaths
from pal.manager.channel import REPLY_TIMEOUT_S, HarnessChannel
from pal.manager.slots import SlotMap, slot_prefix
from pal.manager.vm_states import require_running
from pal.manager.vmnet import Brokered
from pal.snapshots.layout import SnapshotRef
from pal.spec import Egress, WaitPause, egress_to_json
from pal.vmm.qemu import QemuVm
from pal.vmm.usage import ProcessMemory
from pal.wire.models import VolumeMount


def _set_event() -> asyncio.Event:
    ev = asyncio.Event()
    ev.set()
    return ev


@dataclass
class LivePause:
    """One live pause of one VM (live.py; persisted in its state.json)."""

    by: str  # operator | idle | wait
    since: float  # unix seconds
    offloaded: bool = False
    offload_ms: float | None = None
    resident_after: int | None = None  # bytes of guest RAM resident after the offload
    freed: int = 0  # bytes the offload handed back
    working_set: list[tuple[int, int]] = field(default_factory=list)  # to prefetch on resume
    offload_at: float | None = None  # unix seconds: an offload is due then
    wake_at: float | None = None  # unix seconds: the guest's own timer
    tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)
    prefetch: asyncio.Task[int] | None = field(default=None, repr=False)
    port_woken: bool = field(default=False, repr=False)  # a wake for port traffic was posted
    # The metrics sampler's last memory reading of the stopped QEMU (sampling.py), keyed by
    # whether the offload had run: it changes only then, so it is read once per state.
    sampled_memory: tuple[bool, ProcessMemory | None] | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "since": self.since,
            "offloaded": self.offloaded,
            "offloadMs": self.offload_ms,
            "residentAfter": self.resident_after,
            "freed": self.freed,
            "workingSet": [list(r) for r in self.working_set],
            "offloadAt": self.offload_at,
            "wakeAt": self.wake_at,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LivePause:
        return cls(
            by=str(raw.get("by") or "operator"),
            since=float(raw.get("since") or time.time()),
            offloaded=bool(raw.get("offloaded")),
            offload_ms=raw.get("offloadMs"),
            resident_after=raw.get("residentAfter"),
            freed=int(raw.get("freed") or 0),
            working_set=[(int(a), int(b)) for a, b in raw.get("workingSet") or []],
            offload_at=raw.get("offloadAt"),
            wake_at=raw.get("wakeAt"),
        )

    def cancel_timers(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.tasks.clear()


@dataclass
class LiveVm:
    vm_id: str
    tenant_id: str
    qemu: QemuVm
    channel: HarnessChannel
    image: ImagePaths
    incarnation: int
    token: str
    env: dict[str, str]
    memory_mib: int
    vcpus: int
    disk_mib: int
    mem_snapshot_id: str | None = None  # snapshot whose mem is mapped privately (forks)
    mem_ref: SnapshotRef | None = None
    egress: Egress = "none"
    net_limits: dict[str, Any] = field(default_factory=dict)
    mac: str = ""
    brokered: Brokered = field(default_factory=Brokered)
    # Host-side activity: known at once, unlike the guest's 5 s heartbeat.
    active_execs: int = 0
    last_activity_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    last_output_mono: float = 0.0  # host monotonic time of the latest exec output
    net_bytes: tuple[int, int] | None = None  # the gateway's (in, out) counters at the last sample
    files_in_flight: int = 0  # file requests sent to the guest, not answered yet
    files_idle: asyncio.Event = field(default_factory=_set_event)
    op_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Live pause (live.py): the current one, if any, and the VM's wait management rule.
    live: LivePause | None = None
    wait: WaitPause | None = None
    live_paused_ms_total: int = 0  # finished live pauses of this incarnation
    sampled_paused_ms: int = 0  # what the metrics sampler counted so far
    resumed_at: float = 0.0  # host monotonic time of the latest live resume
    parked_snapshot: str | None = None  # parked (parked.py) after this snapshot
    slot: str = ""  # what its host resources are named by (slots.py)
    pooled: bool = False  # in the warm pool, no tenant's yet (pool.py)
    volumes: list[VolumeMount] = field(default_factory=list)  # exported to it (docs/volumes.md)

    def paused_ms(self) -> int:
        """Live-paused time of this incarnation, the current pause included."""
        now = int((time.time() - self.live.since) * 1000) if self.live is not None else 0
        return self.live_paused_ms_total + max(0, now)

    def touch(self) -> None:
        """Host-observed activity now (exec, file, port): what idle suspend goes by."""
        self.last_activity_ms = int(time.time() * 1000)

    async def request_in_flight(
        self,
        msg: p.Message,
        data: bytes | None = None,
        *,
        timeout: float = REPLY_TIMEOUT_S,
        counted: bool = True,
    ) -> tuple[p.Message, bytes]:
        """One request to the guest (a file, a process or a code-context call) with the VM's
        token, sent under its operation lock (ordered with live pauses, like exec) and
        counted as a request in flight, which a live pause waits for (live.py), unless
        ``counted`` is False (a long poll)."""
        async with self.op_lock:
            require_running(self)
            if counted:
                self.files_in_flight += 1
                self.files_idle.clear()
        self.touch()
        try:
            return await self.channel.request({**msg, "tok": self.token}, data, timeout=timeout)
        finally:
            self.touch()
            if counted:
                self.files_in_flight -= 1
                if self.files_in_flight == 0:
                    self.files_idle.set()

    @contextlib.asynccontextmanager
    async def exec_in_flight(
        self, msg: p.Message, abandon: str = p.K_CANCEL, on_slow: str = p.K_DETACH
    ) -> AsyncIterator[AsyncGenerator[p.Message, None]]:
        """The guest's replies to a streaming request (an exec, a cell, a process's output),
        counted as an exec in flight while they last (the VM stays awake). Sent under the
        VM's operation lock: a live pause comes either before (this answers 409
        LIVE_PAUSED, which the scheduler turns into a wake) or after the request is in the
        guest's channel (and its probe, behind it, sees the exec). ``abandon``, ``on_slow``:
        what an early close and a slow reader send the guest (channel.start_stream)."""
        async with self.op_lock:
            require_running(self)
            self.active_execs += 1
            self.touch()
            try:
                replies = await self.channel.start_stream(msg, abandon=abandon, on_slow=on_slow)
            except BaseException:
                self.active_execs -= 1
                raise
        try:
            yield replies
        finally:
            await replies.aclose()
            self.active_execs -= 1
            self.touch()


async def kill_quietly(lv: LiveVm) -> None:
    """Close the VM's channel and kill its QEMU, whatever state either is in (a parked or
    pooled VM thrown away: nobody waits for an error)."""
    with contextlib.suppress(Exception):
        await lv.channel.close()
    with contextlib.suppress(Exception):
        await lv.qemu.kill()


# Seals a VM's brokered secrets for its state file (vmnet.VmNetworking.seal_brokered).
Sealer = Callable[[str, Brokered], Any]


class VmRegistry:
    """The running VMs of this node (``vms``), those being spawned, and their state files."""

    def __init__(self, vms_dir: Path, seal: Sealer) -> None:
        self.vms_dir = vms_dir
        self.vms: dict[str, LiveVm] = {}
        self.spawning: set[str] = set()
        self.slots = SlotMap(slot_prefix(vms_dir))  # vm id -> slot of each VM holding host resources
        self._seal = seal

    def slot_dir(self, slot: str) -> Path:
        # Every VM dir is named by its slot (slots.py), never by a caller's vm id.
        return self.vms_dir / validate_id(slot, "slot")

    def live(self, vm_id: str) -> LiveVm:
        """Prerequisite of every call on a VM: its QEMU runs here (else 409)."""
        lv = self.vms.get(vm_id)
        if lv is None or lv.qemu.exited.is_set():
            raise Conflict(f"VM {vm_id} is not running on this node")
        return lv

    def running(self, vm_id: str) -> LiveVm:
        """A live VM whose vCPUs run: exec, file and port requests need its guest to answer
        (409 LIVE_PAUSED otherwise: vm_states.require_running)."""
        lv = self.live(vm_id)
        require_running(lv)
        return lv

    def mapped_snapshots(self) -> set[str]:
        """Snapshots whose memory a live fork on this node maps (never deleted under it)."""
        return {lv.mem_snapshot_id for lv in self.vms.values() if lv.mem_snapshot_id}

    def alive(self) -> list[LiveVm]:
        return [lv for lv in list(self.vms.values()) if not lv.qemu.exited.is_set()]

    def write_state(self, lv: LiveVm) -> None:
        """Everything needed to re-adopt this VM if the manager process dies (root-only:
        it holds the exec token and the VM's secrets)."""
        self._write(lv.slot, self._state(lv))

    def _write(self, slot: str, state: dict[str, Any]) -> None:
        path = self.slot_dir(slot) / "state.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    def write_prestarted(self, slot: str, prestart_id: str, pid: int) -> None:
        """The state file of a pre-started QEMU (prestart.py): never adopted (a restart kills
        it); a restore that takes it commits by :meth:`write_state` replacing this."""
        self._write(slot, {"vmId": prestart_id, "slot": slot, "pid": pid, "prestarted": True})

    def _state(self, lv: LiveVm) -> dict[str, Any]:
        return {
            "vmId": lv.vm_id,  # the slot's durable mapping (slots.py)
            "slot": lv.slot,
            "tenantId": lv.tenant_id,
            "pid": lv.qemu.pid,
            "incarnation": lv.incarnation,
            "token": lv.token,
            "env": lv.env,
            "image": lv.image.name,
            "boot": lv.image.boot_id,
            "memoryMib": lv.memory_mib,
            "vcpus": lv.vcpus,
            "diskMib": lv.disk_mib,
            "diskFormat": lv.qemu.spec.disk_format,
            "memPath": str(lv.qemu.mem_path),
            "memShare": lv.qemu.mem_share,
            "balloon": lv.qemu.spec.balloon,  # its device set (a later capture records it)
            "runAs": list(lv.qemu.spec.run_as) if lv.qemu.spec.run_as else None,
            "memRef": None
            if lv.mem_ref is None
            else [lv.mem_ref.agent_version_id, lv.mem_ref.vm_id, lv.mem_ref.snapshot_id],
            "egress": egress_to_json(lv.egress),
            "netLimits": lv.net_limits,
            "mac": lv.mac,
            # The real values of brokered secrets, sealed: a restarted node gives a restarted
            # gateway the VM's secrets again.
            "brokered": self._seal(lv.vm_id, lv.brokered),
            "wait": None if lv.wait is None else lv.wait.model_dump(by_alias=True),
            "livePause": None if lv.live is None else lv.live.to_json(),
            "livePausedMs": lv.live_paused_ms_total,
            "parked": lv.parked_snapshot,
            # A pooled VM is never adopted (a restart kills it); a claim commits by this
            # file no longer saying so (pool.py).
            "pooled": lv.pooled,
            "volumes": [v.model_dump() for v in lv.volumes],  # exported again on adoption
        }
