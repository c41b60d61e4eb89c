"""The three vocabularies of a VM's state in one table (pal/scheduler/vocabulary.py): every
state and marker the scheduler's transition table can put a VM in has the node phases and
QEMU runstates it may be in, and those agree with the scheduler's own rules about live
QEMUs."""

from __future__ import annotations

from pal.manager.vm_states import MOVES
from pal.scheduler import states
from pal.scheduler.states import RULES, Marker, VmState
from pal.scheduler.vocabulary import ON_NODE, QEMU_IN, qemu_in
from pal.vmm.runstate import Runstate
from pal.wire.phases import VmPhase


def _pairs() -> set[tuple[VmState, Marker]]:
    """Every (state, marker) the transition table can put a VM in (and each one an action
    finishes, checked to be among them)."""
    out = {(r.to, r.marker) for r in RULES}
    for r in RULES:
        if r.frm is not None and r.during is not None:
            assert {(r.frm, m) for m in r.during} <= out, f"{r.action} finishes a pair nothing reaches"
    return out


def test_every_scheduler_state_and_marker_has_a_node_phase_and_a_qemu_runstate() -> None:
    missing = sorted(f"{s.value} ({m.value or 'none'})" for s, m in _pairs() - ON_NODE.keys())
    assert missing == [], f"no node phase for {missing} (pal/scheduler/vocabulary.py ON_NODE)"
    for (state, marker), phases in ON_NODE.items():
        assert phases, (state, marker)
        assert qemu_in(state, marker), (state, marker)


def test_the_table_covers_each_vocabulary() -> None:
    assert set(QEMU_IN) == {None, *VmPhase} == set(MOVES) | {None}
    assert {p for phases in ON_NODE.values() for p in phases} == {None, *VmPhase}
    assert {r for runs in QEMU_IN.values() for r in runs} == {None, *Runstate}


def test_it_agrees_with_the_scheduler_rules_on_live_qemus() -> None:
    live = {VmPhase.RUNNING, VmPhase.LIVE_PAUSED, VmPhase.OFFLOADED}
    for (state, marker), phases in ON_NODE.items():
        if states.has_live_qemu(state, marker):
            assert phases & live, f"{state} ({marker}) has a live QEMU by states.py"
        if states.is_live_paused(state, marker):
            assert {VmPhase.LIVE_PAUSED, VmPhase.OFFLOADED} <= phases
        if state == VmState.PAUSED and not states.is_live_paused(state, marker):
            assert not phases & live, "a snapshot-paused VM runs nothing (parked at most)"
        if state == VmState.RUNNING:
            assert Runstate.RUNNING in qemu_in(state, marker)
