"""Host slots: the internal names of a VM's host-side resources.

A VM's directory (``vms/<slot>``), its QEMU's uid, its cgroup, its network namespace and
its sockets are named by a *slot*, never by the public vm id. The slot is mapped to the
vm id that holds it now, so one VM's resources can change hands without being renamed: a
pooled VM (pool.py) is made under one id and claimed under a tenant's, and a stop of one
incarnation never frees the resources of the next incarnation of the same vm id.

The mapping is durable in one place: the ``slot`` directory's ``state.json`` names its
vm id (vm.VmRegistry.write_state, atomically replaced), and adopt.py rebuilds this map
from those files after a restart. A slot directory without a state file belongs to no
VM: adoption frees everything named by it.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from pal.ids import validate_id


def slot_prefix(vms_dir: Path) -> str:
    """``s<6 hex>-``: the slots of one data dir, told apart from other nodes' on this host
    (cgroups are host-wide: a check for leftovers needs to know which are its own)."""
    return "s" + hashlib.sha256(str(Path(vms_dir).resolve()).encode()).hexdigest()[:6] + "-"


def new_slot(prefix: str) -> str:
    """A fresh slot name: short (netns and cgroup names carry it), never a vm id's."""
    return prefix + secrets.token_hex(5)


class SlotMap:
    """vm id -> slot of the VMs this node holds (live, parked, pooled, being spawned)."""

    def __init__(self, prefix: str = "s-") -> None:
        self.prefix = prefix
        self._slots: dict[str, str] = {}

    def assign(self, vm_id: str, slot: str | None = None) -> str:
        """``vm_id`` holds ``slot`` (a new one when None) from now on."""
        slot = validate_id(slot or new_slot(self.prefix), "slot")
        self._slots[vm_id] = slot
        return slot

    def get(self, vm_id: str) -> str | None:
        return self._slots.get(vm_id)

    def rekey(self, old_vm_id: str, new_vm_id: str) -> str:
        """The slot of ``old_vm_id`` is ``new_vm_id``'s from now on (a pool claim)."""
        slot = self._slots.pop(old_vm_id)
        self._slots[new_vm_id] = slot
        return slot

    def release(self, vm_id: str, slot: str | None = None) -> str | None:
        """Forget ``vm_id``'s slot; with ``slot``, only if it still holds that one (a newer
        incarnation of the same vm id may hold another by now)."""
        held = self._slots.get(vm_id)
        if held is None or (slot is not None and held != slot):
            return None
        return self._slots.pop(vm_id)

    def slots(self) -> set[str]:
        return set(self._slots.values())

    def __contains__(self, vm_id: object) -> bool:
        return vm_id in self._slots
