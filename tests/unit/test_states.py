"""The transition table, exhaustively: every (state, action, marker) including START."""

from __future__ import annotations

import itertools

import pytest

from pal.errors import Conflict
from pal.scheduler import states
from pal.scheduler.states import START, Action, IllegalTransition, Marker, VmState

S, A, M = VmState, Action, Marker
PAUSING = {M.PAUSING, M.IDLE_PAUSING}
LIVE = {M.LIVE, M.LIVE_IDLE, M.LIVE_WAIT}
# (from, action) -> (to, markers it may finish or None for any). The lifecycle spec's
# transitions plus Pal's documented additions; a change to the table must change this too.
EXPECTED: dict[tuple[VmState | None, Action], tuple[VmState, set[Marker] | None]] = {
    (START, A.SCHEDULE): (S.PENDING, None),
    (S.PENDING, A.PLACE): (S.SPAWNING, None),
    (S.SPAWNING, A.COME_UP): (S.RUNNING, None),
    (S.SPAWNING, A.FAIL_SPAWN): (S.FAILED, {M.SPAWNING, M.FORKING}),
    (S.RUNNING, A.PAUSE): (S.DRAINING, None),
    (S.RUNNING, A.IDLE_PAUSE): (S.DRAINING, None),
    (S.RUNNING, A.DELETE): (S.DRAINING, None),
    (S.DRAINING, A.FINISH_PAUSE): (S.PAUSED, PAUSING),
    (S.DRAINING, A.ROLL_BACK_PAUSE): (S.RUNNING, PAUSING),
    (S.DRAINING, A.FINISH_DELETE): (S.TERMINATED, {M.DELETING}),
    (S.PAUSED, A.RESUME): (S.SPAWNING, {M.NONE}),
    (S.SPAWNING, A.ROLL_BACK_RESUME): (S.PAUSED, {M.RESUMING}),
    (START, A.FORK): (S.SPAWNING, None),
    (S.PENDING, A.FAIL_SPAWN): (S.FAILED, None),
    (S.PENDING, A.DELETE): (S.TERMINATED, None),
    (S.RUNNING, A.LOSE): (S.FAILED, None),
    (S.SPAWNING, A.LOSE): (S.FAILED, None),
    (S.DRAINING, A.LOSE): (S.FAILED, PAUSING),
    (S.PAUSED, A.DELETE): (S.DRAINING, None),
    (S.PAUSED, A.LOSE): (S.FAILED, None),
    (S.RUNNING, A.RECOVER): (S.PAUSED, None),
    (S.PAUSED, A.RECOVER): (S.PAUSED, LIVE),
    (S.FAILED, A.DELETE): (S.DRAINING, None),
    (S.SPAWNING, A.DELETE): (S.DRAINING, None),
    # live pause
    (S.RUNNING, A.LIVE_PAUSE): (S.PAUSED, None),
    (S.RUNNING, A.IDLE_LIVE_PAUSE): (S.PAUSED, None),
    (S.RUNNING, A.WAIT_PAUSE): (S.PAUSED, None),
    (S.PAUSED, A.LIVE_RESUME): (S.RUNNING, LIVE),
    (S.PAUSED, A.LIVE_PAUSE): (S.PAUSED, LIVE),
    (S.PAUSED, A.PAUSE): (S.DRAINING, LIVE),
    (S.PAUSED, A.IDLE_PAUSE): (S.DRAINING, {M.LIVE_IDLE, M.LIVE_WAIT}),
}
SPEC_EDGES = {  # the reference lifecycle's "Transitions" table (fork children enter at spawning)
    (START, S.PENDING),
    (S.PENDING, S.SPAWNING),
    (S.SPAWNING, S.RUNNING),
    (S.SPAWNING, S.FAILED),
    (S.RUNNING, S.DRAINING),
    (S.DRAINING, S.PAUSED),
    (S.DRAINING, S.RUNNING),
    (S.DRAINING, S.TERMINATED),
    (S.PAUSED, S.SPAWNING),
    (S.SPAWNING, S.PAUSED),
    (START, S.SPAWNING),
    # docs/live-pause.md: Pause and Resume of the same live VM
    (S.RUNNING, S.PAUSED),
    (S.PAUSED, S.RUNNING),
}
CHANGING = [a for a in Action if a not in states.STAYS]
CASES = list(itertools.product([START, *VmState], CHANGING, list(Marker)))


def _id(case: tuple[VmState | None, Action, Marker]) -> str:
    frm, action, marker = case
    return f"{frm.value if frm else 'start'}[{marker.value or '-'}]:{action.value}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_state_action_and_marker_is_allowed_exactly_when_listed(
    case: tuple[VmState | None, Action, Marker],
) -> None:
    frm, action, marker = case
    want = EXPECTED.get((frm, action))
    if want is not None and (want[1] is None or marker in want[1]):
        assert states.check("vm-1", frm, action, marker) == want[0]
        assert states.allowed(frm, action, marker)
    else:
        with pytest.raises(IllegalTransition) as ei:
            states.check("vm-1", frm, action, marker)
        assert "vm-1" in str(ei.value) and action.value in str(ei.value)
        assert not states.allowed(frm, action, marker)


def test_the_table_has_the_spec_transitions_and_pal_additions_only() -> None:
    assert {(r.frm, r.to) for r in states.RULES} == {(frm, to) for (frm, _), (to, _) in EXPECTED.items()}
    spec = [r for r in states.RULES if r.origin == "spec"]
    assert {(r.frm, r.to) for r in spec} == SPEC_EDGES


def test_in_between_states_always_carry_the_marker_of_the_action_under_way() -> None:
    for r in states.RULES:
        if r.to in (S.SPAWNING, S.DRAINING):
            assert r.marker != M.NONE, r
        elif r.to == S.PAUSED:  # the marker of a pause says its kind: snapshot or live
            assert r.marker in {M.NONE} | LIVE, r
        else:
            assert r.marker == M.NONE, r


def test_actions_that_keep_the_state() -> None:
    assert states.check("vm-1", S.RUNNING, A.EXEC) == S.RUNNING
    assert states.check("vm-1", S.PAUSED, A.FORK_FROM) == S.PAUSED
    for frm in set(VmState) - {S.RUNNING}:
        with pytest.raises(IllegalTransition):
            states.check("vm-1", frm, A.EXEC)
    with pytest.raises(IllegalTransition, match="resume it first"):
        states.check("vm-1", S.PAUSED, A.EXEC, hint="VM vm-1 was paused by an operator; resume it first")


def test_an_illegal_transition_is_a_409_conflict() -> None:
    with pytest.raises(Conflict) as ei:
        states.check("vm-7", S.PAUSED, A.PAUSE)
    err = ei.value
    assert err.status == 409 and err.code == "FAILED_PRECONDITION"
    assert err.message == "VM vm-7 is paused: cannot pause (allowed when live-paused, running)"
    with pytest.raises(Conflict) as ei:
        states.check("vm-7", S.PAUSED, A.RESUME, M.LIVE)
    want = "VM vm-7 is paused (live:operator): cannot resume (allowed when paused (snapshot))"
    assert ei.value.message == want
    with pytest.raises(Conflict, match=r"allowed when live-paused by idle or wait, running\)$"):
        states.check("vm-7", S.PAUSED, A.IDLE_PAUSE, M.LIVE)


def test_terminated_is_final() -> None:
    assert not any(r.frm == S.TERMINATED for r in states.RULES)


def test_only_schedule_and_fork_create_vms() -> None:
    assert {r.action for r in states.RULES if r.frm is START} == {A.SCHEDULE, A.FORK}


def test_slot_holding_states() -> None:
    assert {S.PENDING, S.SPAWNING, S.RUNNING, S.DRAINING} == states.SLOT_HOLDING
    assert S.PAUSED not in states.SLOT_HOLDING


def test_a_live_paused_vm_holds_its_slot_and_a_snapshot_paused_one_does_not() -> None:
    for m in LIVE:
        assert states.holds_slot(S.PAUSED, m) and states.is_live_paused(S.PAUSED, m)
    assert not states.holds_slot(S.PAUSED, M.NONE) and not states.is_live_paused(S.PAUSED, M.NONE)
    for st in states.SLOT_HOLDING:
        assert states.holds_slot(st, M.NONE)
    assert not states.holds_slot(S.FAILED) and not states.holds_slot(S.TERMINATED)


def test_a_live_qemu_is_a_running_or_live_paused_vm_and_nothing_else() -> None:
    with_qemu = {(st, m) for st in S for m in M if states.has_live_qemu(st, m)}
    assert with_qemu == {(S.RUNNING, m) for m in M} | {(S.PAUSED, m) for m in LIVE}
    assert all(states.holds_slot(st, m) for st, m in with_qemu)  # each occupies its node
