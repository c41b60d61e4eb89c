"""The transition table, exhaustively: every (from, to) pair including START."""

from __future__ import annotations

import itertools

import pytest

from pal.scheduler import states
from pal.scheduler.states import START, IllegalTransition, VmState

S = VmState
# The lifecycle spec's transitions plus Pal's documented additions; a change to the
# table must change this list too.
EXPECTED_LEGAL = {
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
    (S.PENDING, S.FAILED),
    (S.PENDING, S.TERMINATED),
    (S.RUNNING, S.FAILED),
    (S.DRAINING, S.FAILED),
    (S.PAUSED, S.DRAINING),
    (S.PAUSED, S.FAILED),
    (S.FAILED, S.DRAINING),
    (S.SPAWNING, S.DRAINING),
}
ALL_PAIRS = list(itertools.product([START, *VmState], list(VmState)))


def _id(pair: tuple[VmState | None, VmState]) -> str:
    frm, to = pair
    return f"{frm.value if frm else 'start'}->{to.value}"


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=_id)
def test_every_pair_is_allowed_exactly_when_listed(pair: tuple[VmState | None, VmState]) -> None:
    frm, to = pair
    if pair in EXPECTED_LEGAL:
        assert states.check("vm-1", frm, to)  # a non-empty trigger
        assert states.is_allowed(frm, to)
    else:
        with pytest.raises(IllegalTransition) as ei:
            states.check("vm-1", frm, to)
        assert "vm-1" in str(ei.value) and to.value in str(ei.value)
        assert not states.is_allowed(frm, to)


def test_terminated_is_final() -> None:
    assert states.allowed_from(S.TERMINATED) == set()


def test_only_spec_entry_points_create_vms() -> None:
    assert states.allowed_from(START) == {S.PENDING, S.SPAWNING}


def test_slot_holding_states() -> None:
    assert {S.PENDING, S.SPAWNING, S.RUNNING, S.DRAINING} == states.SLOT_HOLDING
    assert S.PAUSED not in states.SLOT_HOLDING
