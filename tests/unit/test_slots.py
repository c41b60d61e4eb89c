"""Host slots (pal/manager/slots.py): what a VM's host resources are named by."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.errors import InvalidRequest
from pal.manager.slots import SlotMap, new_slot, slot_prefix


def test_each_vm_gets_its_own_slot_never_named_by_its_id(tmp_path: Path) -> None:
    prefix = slot_prefix(tmp_path / "vms")
    assert prefix != slot_prefix(tmp_path / "other" / "vms")  # two nodes' slots never collide
    slots = SlotMap(prefix)
    a, b = slots.assign("vm-a"), slots.assign("vm-b")
    assert a != b and a.startswith(prefix) and "vm-a" not in a
    assert slots.get("vm-a") == a and slots.slots() == {a, b}


def test_a_claim_moves_the_slot_to_the_new_vm_id() -> None:
    slots = SlotMap()
    s = slots.assign("pool-1")
    assert slots.rekey("pool-1", "vm-tenant") == s
    assert slots.get("vm-tenant") == s and "pool-1" not in slots


def test_a_stop_of_an_old_incarnation_never_frees_the_new_ones_slot() -> None:
    slots = SlotMap()
    old = slots.assign("vm-a")
    new = slots.assign("vm-a")  # the next incarnation spawned while the old one is freed
    assert slots.release("vm-a", old) is None
    assert slots.get("vm-a") == new
    assert slots.release("vm-a", new) == new and slots.get("vm-a") is None


def test_an_adopted_slot_is_kept_and_a_bad_one_refused() -> None:
    slots = SlotMap()
    assert slots.assign("vm-a", "vm-a") == "vm-a"  # a dir of an older Pal: its own id
    with pytest.raises(InvalidRequest):
        slots.assign("vm-b", "../etc")
    assert len({new_slot("s-") for _ in range(100)}) == 100
