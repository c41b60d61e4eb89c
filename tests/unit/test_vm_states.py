"""The node's states of a VM (pal/manager/vm_states.py): read from the VM's fields, moved
only along the table, and a guest call on a live-paused VM refused with 409 LIVE_PAUSED."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pal.errors import LivePaused
from pal.manager.vm_states import MOVES, InvalidMove, VmPhase, check_move, phase_of, require_running

P = VmPhase


def vm(
    *, live: object = None, parked: str | None = None, exited: bool = False, pooled: bool = False
) -> SimpleNamespace:
    qemu = SimpleNamespace(exited=asyncio.Event())
    if exited:
        qemu.exited.set()
    return SimpleNamespace(vm_id="vm-1", qemu=qemu, live=live, parked_snapshot=parked, pooled=pooled)


def paused(offloaded: bool = False) -> SimpleNamespace:
    return SimpleNamespace(by="idle", offloaded=offloaded)


def test_the_state_is_read_from_the_vm() -> None:
    assert phase_of(vm()) is P.RUNNING
    assert phase_of(vm(live=paused())) is P.LIVE_PAUSED
    assert phase_of(vm(live=paused(offloaded=True))) is P.OFFLOADED
    assert phase_of(vm(parked="snap-1")) is P.PARKED
    assert phase_of(vm(pooled=True)) is P.POOLED
    assert phase_of(vm(pooled=True, exited=True)) is P.GONE
    assert phase_of(vm(live=paused(), exited=True)) is P.GONE


@pytest.mark.parametrize("start", list(P))
@pytest.mark.parametrize("to", list(P))
def test_only_the_moves_of_the_table_pass_the_guard(start: VmPhase, to: VmPhase) -> None:
    v = {
        P.RUNNING: vm(),
        P.LIVE_PAUSED: vm(live=paused()),
        P.OFFLOADED: vm(live=paused(offloaded=True)),
        P.PARKED: vm(parked="snap-1"),
        P.POOLED: vm(pooled=True),
        P.GONE: vm(exited=True),
    }[start]
    if to in MOVES[start]:
        check_move(v, to)
    else:
        with pytest.raises(InvalidMove) as err:
            check_move(v, to)
        assert err.value.status == 409 and err.value.code == "INVALID_VM_STATE"


def test_a_live_paused_vm_refuses_guest_calls_with_live_paused() -> None:
    require_running(vm())
    with pytest.raises(LivePaused) as err:
        require_running(vm(live=paused()))
    assert (err.value.status, err.value.code) == (409, "LIVE_PAUSED")
