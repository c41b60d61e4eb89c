"""The three vocabularies of a VM's state, mapped in one table, next to the transition
table (states.py):

- the scheduler's: a :class:`VmState` and its :class:`Marker`, in the store (states.py);
- the node's: a :class:`VmPhase` of the VM's QEMU on its node (pal/wire/phases.py; the moves
  between them: pal/manager/vm_states.py), or none (no VM of that id on the node: not yet,
  being spawned, or stopped and forgotten);
- QEMU's: a :class:`Runstate` of its process (pal/vmm/runstate.py), or none (no process).

The node acts first and the row follows (a live pause, a resume, a crash the scheduler has
not heard of yet), and a multi-step operation records its marker before the node acts, so a
row may meet more than one node phase: :data:`ON_NODE` lists each one it may meet, and
reconciliation (reconcile.py) settles any other. :data:`QEMU_IN` says which runstates a node
phase may be in (a capture stops a running or live-paused guest for a moment; a spawn goes
through the incoming states before its VM has a phase).

In words (scheduler state and marker: node phases; the runstates follow from QEMU_IN):

- pending: none;
- spawning (spawning, forking): none (being spawned), running, gone; a claim of the warm
  pool takes a pooled one; (resuming): also parked (the resume continues it);
- running: running; live-paused or offloaded (a live pause the row has not recorded
  yet); gone (a crash);
- draining (pausing, idle-pausing, deleting): running, live-paused, offloaded, parked,
  none, gone (each step of the capture and the stop);
- paused (snapshot): none, parked, gone;
- paused (live:*): live-paused, offloaded, running (a resume the row has not recorded
  yet), gone;
- failed, terminated: none or gone, or any while a stray runs (reconciliation stops it).
"""

from __future__ import annotations

from pal.scheduler.states import LIVE_MARKERS, Marker, VmState
from pal.vmm.runstate import Runstate
from pal.wire.phases import VmPhase

S, M, P, R = VmState, Marker, VmPhase, Runstate
Phase = VmPhase | None  # None: no VM of that id on the node
State = Runstate | None  # None: no QEMU process

# The runstates of a QEMU whose VM is in a node phase (None: the VM is being spawned, its
# QEMU not enlisted yet, or there is no VM).
QEMU_IN: dict[Phase, frozenset[State]] = {
    None: frozenset({None, R.IDLE, R.STARTING, R.INCOMING, R.LOADING, R.PAUSED, R.EXITED}),
    P.RUNNING: frozenset({R.RUNNING, R.PAUSED, R.CAPTURING}),  # a fork's capture stops it briefly
    P.LIVE_PAUSED: frozenset({R.PAUSED, R.CAPTURING}),
    P.OFFLOADED: frozenset({R.PAUSED, R.CAPTURING}),
    P.PARKED: frozenset({R.PAUSED}),
    P.POOLED: frozenset({R.PAUSED}),
    P.GONE: frozenset({R.EXITED}),
}

_ANY: frozenset[Phase] = frozenset({None, *VmPhase})
_SPAWNING: frozenset[Phase] = frozenset({None, P.RUNNING, P.GONE})
_DRAINING: frozenset[Phase] = frozenset({P.RUNNING, P.LIVE_PAUSED, P.OFFLOADED, P.PARKED, None, P.GONE})
_LIVE: frozenset[Phase] = frozenset({P.LIVE_PAUSED, P.OFFLOADED, P.RUNNING, P.GONE})

# THE mapping: each scheduler state and marker -> the node phases its VM may be in.
ON_NODE: dict[tuple[VmState, Marker], frozenset[Phase]] = {
    (S.PENDING, M.NONE): frozenset({None}),
    (S.SPAWNING, M.SPAWNING): _SPAWNING | {P.POOLED},  # a claim re-keys a pooled VM
    (S.SPAWNING, M.FORKING): _SPAWNING,
    (S.SPAWNING, M.RESUMING): _SPAWNING | {P.PARKED},
    (S.RUNNING, M.NONE): frozenset({P.RUNNING, P.LIVE_PAUSED, P.OFFLOADED, P.GONE}),
    (S.DRAINING, M.PAUSING): _DRAINING,
    (S.DRAINING, M.IDLE_PAUSING): _DRAINING,
    (S.DRAINING, M.DELETING): _DRAINING,
    (S.PAUSED, M.NONE): frozenset({None, P.PARKED, P.GONE}),
    **{(S.PAUSED, m): _LIVE for m in LIVE_MARKERS},
    (S.FAILED, M.NONE): _ANY,
    (S.TERMINATED, M.NONE): _ANY,
}


def qemu_in(state: VmState, marker: Marker) -> frozenset[State]:
    """The QEMU runstates a VM in ``state`` carrying ``marker`` may be in."""
    out: set[State] = set()
    for phase in ON_NODE[(state, marker)]:
        out |= QEMU_IN[phase]
    return frozenset(out)
