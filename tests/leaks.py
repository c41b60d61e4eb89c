"""What a node leaves behind, held against what its store says: the orphan checks of the
kill -9 matrix and the churn soak (issue 9, item 7).

A VM that is live (running, or live-paused) has exactly one QEMU, its ``vms/<slot>`` dir
(whose state.json names the VM: pal/manager/slots.py), its network namespace, its gateway
registration and its cgroup, all named by its slot. A snapshot-paused VM whose
QEMU the node parked (pal/manager/parked.py: its state.json names the VM's snapshot) has
all of them but the gateway registration, as have the node's pooled VMs and pre-started
QEMUs (pal/manager/pool.py, prestart.py). Any other VM has none of them. No row is left
in an in-between state, each tenant's slot count is the number of its slot-holding VMs,
and no snapshot, staging dir or fork memory file outlives its use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.manager.slots import slot_prefix
from pal.network import netns
from pal.scheduler.states import has_live_qemu, holds_slot, is_live_paused
from pal.snapshots.layout import FORK_MEM_DIRNAME, STAGING_DIRNAME
from pal.snapshots.local import LocalTier
from pal.store import Store, VmRecord
from pal_tools.localcluster.processes import qemu_pids_under

IN_BETWEEN = frozenset({"pending", "spawning", "draining"})
_VM_DIR = re.compile(rb"/vms/([A-Za-z0-9][A-Za-z0-9._-]*)/")


def open_store(data_dir: Path) -> Store:
    """The `pal up` store of ``data_dir``, for reading beside the running server."""
    return Store(f"sqlite:///{Settings.from_env(data_dir).db_path}", run_migrations=False)


def vm_states(data_dir: Path) -> dict[str, dict[str, Any]]:
    """slot (``vms/`` dir) -> its state.json (the VM that holds it), for those that have one."""
    out: dict[str, dict[str, Any]] = {}
    vms_dir = Settings.from_env(data_dir).vms_dir
    for d in sorted(vms_dir.iterdir()) if vms_dir.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            out[d.name] = json.loads((d / "state.json").read_text())
    return out


def vm_slots(data_dir: Path) -> dict[str, str]:
    """vm id -> the slot (``vms/`` dir) its state.json says it holds."""
    return {str(st["vmId"]): slot for slot, st in vm_states(data_dir).items() if "vmId" in st}


def pooled_vms(data_dir: Path) -> dict[str, str]:
    """The warm pool's VMs (pal/manager/pool.py): pool id -> slot."""
    return {str(st["vmId"]): slot for slot, st in vm_states(data_dir).items() if st.get("pooled")}


def prestarted_qemus(data_dir: Path) -> dict[str, str]:
    """QEMUs waiting for a restore (pal/manager/prestart.py): prestart id -> slot."""
    return {str(st["vmId"]): slot for slot, st in vm_states(data_dir).items() if st.get("prestarted")}


def data_mib(path: Path) -> float:
    """MiB of data in a sparse file (what its holes leave)."""
    with open(path, "rb") as f:
        size, pos, total = os.fstat(f.fileno()).st_size, 0, 0
        while pos < size:
            try:
                start = os.lseek(f.fileno(), pos, os.SEEK_DATA)
            except OSError:
                break
            pos = os.lseek(f.fileno(), start, os.SEEK_HOLE)
            total += pos - start
    return total / (1 << 20)


def vm_dir_of(data_dir: Path, vm_id: str) -> Path:
    """The ``vms/<slot>`` dir of ``vm_id`` (a path that does not exist if it has none)."""
    slot = vm_slots(data_dir).get(vm_id, f"no-slot-of-{vm_id}")
    return Settings.from_env(data_dir).vms_dir / slot


def qemus_by_vm(data_dir: Path) -> dict[str, list[int]]:
    """QEMU pids under ``data_dir`` by the VM whose dir their command line names (the
    slot itself when no state file names a VM, "?": no dir)."""
    by_slot = {slot: vm_id for vm_id, slot in vm_slots(data_dir).items()}
    out: dict[str, list[int]] = {}
    for pid in qemu_pids_under(data_dir):
        with contextlib.suppress(OSError):
            m = _VM_DIR.search(Path(f"/proc/{pid}/cmdline").read_bytes())
            slot = m.group(1).decode() if m else "?"
            out.setdefault(by_slot.get(slot, slot), []).append(pid)
    return out


def gateway_vms(data_dir: Path) -> set[str]:
    """The VMs the node's egress gateway holds state for (its control socket's ping)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(data_dir / "run" / "gateway.sock"))
        s.sendall(b'{"op": "ping"}\n')
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    reply = json.loads(buf.split(b"\n", 1)[0])
    assert reply.get("ok"), reply
    return set(reply.get("vms") or [])


def cgroup_parents() -> list[Path]:
    """Where the node puts each VM's cgroup (none when cgroups are unavailable here)."""
    from pal.errors import Unavailable
    from pal.vmm import cgroups

    try:
        return list(cgroups.host().parents.values())
    except Unavailable:
        return []


def is_live(vm: VmRecord) -> bool:
    return has_live_qemu(vm.state, vm.marker)


def is_parked(settings: Settings, vm: VmRecord) -> bool:
    """A snapshot-paused VM whose node keeps its stopped QEMU for its next resume."""
    if vm.state != "paused" or is_live_paused(vm.state, vm.marker) or not vm.snapshot_id:
        return False
    try:
        st = json.loads((vm_dir_of(settings.data_dir, vm.vm_id) / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(st.get("parked")) and st.get("parked") == vm.snapshot_id


@dataclass
class NodeView:
    rows: dict[str, VmRecord]
    slots: dict[str, int]  # tenant id -> slots the store counts for it


def view(data_dir: Path) -> NodeView:
    store = open_store(data_dir)
    try:
        rows = {v.vm_id: v for v in store.list_vms()}
        slots = {t.id: store.count_slots(t.id) for t in store.list_tenants()}
    finally:
        store.close()
    return NodeView(rows, slots)


def problems(data_dir: Path) -> list[str]:
    """Every way the node's processes, files and kernel objects disagree with its store,
    read while nothing is in flight. Empty when the two tell one story."""
    settings = Settings.from_env(data_dir)
    v = view(data_dir)
    live = {vm_id for vm_id, vm in v.rows.items() if is_live(vm)}
    parked = {vm_id for vm_id, vm in v.rows.items() if is_parked(settings, vm)}
    pool = pooled_vms(data_dir)  # no row: the node's own, each with all of the above
    pre = prestarted_qemus(data_dir)  # the same
    held = live | parked | set(pool) | set(pre)  # a QEMU, a vms/ dir, a namespace, a cgroup
    out: list[str] = []

    for vm in v.rows.values():
        if vm.state in IN_BETWEEN:
            out.append(f"{vm.vm_id} left {vm.state} ({vm.marker})")
        if vm.holds_slot != holds_slot(vm.state, vm.marker):
            out.append(f"{vm.vm_id} ({vm.state}) holds_slot={vm.holds_slot}")
    for tenant, counted in v.slots.items():
        want = sum(1 for vm in v.rows.values() if vm.tenant_id == tenant and holds_slot(vm.state, vm.marker))
        if counted != want:
            out.append(f"tenant {tenant}: {counted} slots counted, {want} VMs hold one")

    qemus = qemus_by_vm(data_dir)
    for vm_id, pids in sorted(qemus.items()):
        if vm_id not in held or len(pids) != 1:
            state = v.rows[vm_id].state if vm_id in v.rows else "no row"
            out.append(f"QEMU {pids} of {vm_id} ({state})")
    out += [f"live or parked VM {vm_id} has no QEMU" for vm_id in sorted(held - set(qemus))]

    slots = vm_slots(data_dir)
    held_slots = {slots[vm_id] for vm_id in held if vm_id in slots}
    dirs = {d.name for d in settings.vms_dir.iterdir()} if settings.vms_dir.is_dir() else set()
    out += [f"vms/{name} of a VM that is not live" for name in sorted(dirs - held_slots)]
    out += [f"live VM {vm_id} has no vms/ dir" for vm_id in sorted(live - set(slots))]

    tag = netns.node_tag(data_dir)
    want_ns = {netns.ns_name(tag, slot) for slot in held_slots}
    got_ns = set(netns.list_names(tag))
    out += [f"network namespace {n} left" for n in sorted(got_ns - want_ns)]
    out += [f"network namespace {n} missing" for n in sorted(want_ns - got_ns)]

    registered = gateway_vms(data_dir)
    out += [f"gateway still holds {vm_id}" for vm_id in sorted(registered - live)]
    out += [f"gateway lost live VM {vm_id}" for vm_id in sorted(live - registered)]

    ours = slot_prefix(settings.vms_dir)  # cgroups are host-wide: only this node's slots
    for parent in cgroup_parents():
        out += [
            f"cgroup {d} left"
            for d in sorted(parent.iterdir() if parent.is_dir() else [])
            if d.is_dir() and d.name.startswith(ours) and d.name not in held_slots
        ]

    root = settings.snapshots_root
    staging = sorted(os.listdir(root / STAGING_DIRNAME)) if (root / STAGING_DIRNAME).is_dir() else []
    out += [f"snapshots/{STAGING_DIRNAME}/{name} left" for name in staging]
    mapped = {vm.mem_snapshot_id for vm in v.rows.values() if vm.vm_id in live and vm.mem_snapshot_id}
    fork_mem = root / FORK_MEM_DIRNAME
    for name in sorted(os.listdir(fork_mem)) if fork_mem.is_dir() else []:
        if name.removesuffix(".mem") not in mapped:
            out.append(f"snapshots/{FORK_MEM_DIRNAME}/{name} no live fork maps")
    for av, vm_id in LocalTier(root).vm_dirs():
        owner = v.rows.get(vm_id)
        snaps = {m.get("snapshotId") for m in LocalTier(root).list_vm(av, vm_id)}
        if owner is None or owner.state == "terminated":
            if snaps - mapped or not snaps:
                out.append(f"snapshots of {vm_id} ({owner.state if owner else 'no row'}): {sorted(snaps)}")
    for vm in v.rows.values():
        if vm.state == "paused" and not is_live_paused(vm.state, vm.marker):
            if not vm.agent_version_id or vm.snapshot_id not in {
                m.get("snapshotId") for m in LocalTier(root).list_vm(vm.agent_version_id, vm.vm_id)
            }:
                out.append(f"paused VM {vm.vm_id} has no snapshot {vm.snapshot_id}")
    return out


def snapshot_bytes(data_dir: Path) -> int:
    """Bytes allocated by every file under the snapshots root: snapshots, staging, fork
    memory files and queued jobs alike."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(Settings.from_env(data_dir).snapshots_root):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total
