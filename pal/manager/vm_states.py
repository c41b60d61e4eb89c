"""The states of a VM on this node, as the manager sees them, and the moves between them.

These are the node's own facts about one QEMU (the phases: pal/wire/phases.py; the
scheduler's lifecycle states are in pal/scheduler/states.py, and pal/scheduler/vocabulary.py
maps them to these phases and to QEMU's runstates). A state is read from the VM's fields, so
it can never disagree with them; a helper that changes those fields first asks
:func:`check_move`, which raises :class:`InvalidMove` (409) for a move the table does not
allow.

| from \\ to | running | live-paused | offloaded | parked | gone |
|---|---|---|---|---|---|
| running | - | pause (live.py) | - | snapshot pause (snapshot.py) | stop, crash |
| live-paused | resume (live.py) | - | offload (live.py) | - | stop, crash |
| offloaded | resume (live.py) | - | - | - | stop, crash |
| parked | resume from its snapshot (restore.py) | - | - | - | discard (parked.py) |
| pooled | claim (pool.py) | - | - | - | discard, crash (pool.py) |
| gone | - | - | - | - | - |

A VM being spawned has no state here yet: it enters as *running* (spawn.py, adopt.py; an
adopted VM may enter as live-paused or offloaded, as its state file says), or as *pooled*
(pool.py: made for the warm pool, stopped and offloaded, never run by a tenant). A claim
is the one way out of *pooled* into a tenant's hands; its marker is the VM's state file,
which says ``pooled`` until the claim commits (a restart kills a pooled VM: never adopted,
never handed out twice).
"""

from __future__ import annotations

from typing import Any, Protocol

from pal.errors import Conflict, LivePaused
from pal.wire.phases import VmPhase as VmPhase

P = VmPhase
MOVES: dict[VmPhase, frozenset[VmPhase]] = {
    P.RUNNING: frozenset({P.LIVE_PAUSED, P.PARKED, P.GONE}),
    P.LIVE_PAUSED: frozenset({P.RUNNING, P.OFFLOADED, P.GONE}),
    P.OFFLOADED: frozenset({P.RUNNING, P.GONE}),
    P.PARKED: frozenset({P.RUNNING, P.GONE}),
    P.POOLED: frozenset({P.RUNNING, P.GONE}),
    P.GONE: frozenset(),
}


class InvalidMove(Conflict):
    """A helper asked for a move the table does not allow (a bug, or a race it lost)."""

    code = "INVALID_VM_STATE"


class _Pause(Protocol):
    by: str
    offloaded: bool


class _Vm(Protocol):
    """What the state of a VM is read from (vm.LiveVm)."""

    vm_id: str
    qemu: Any  # .exited: asyncio.Event
    live: Any  # _Pause | None
    parked_snapshot: str | None
    pooled: bool


def phase_of(vm: _Vm) -> VmPhase:
    if vm.qemu.exited.is_set():
        return P.GONE
    if vm.parked_snapshot is not None:
        return P.PARKED
    if vm.pooled:
        return P.POOLED
    if vm.live is None:
        return P.RUNNING
    return P.OFFLOADED if vm.live.offloaded else P.LIVE_PAUSED


def check_move(vm: _Vm, to: VmPhase) -> None:
    """The guard before a helper changes ``vm`` into ``to``."""
    now = phase_of(vm)
    if to not in MOVES[now]:
        raise InvalidMove(f"VM {vm.vm_id} is {now.value}: it cannot become {to.value}")


def require_running(vm: _Vm) -> None:
    """Exec, files and ports need the guest's vCPUs running: 409 LIVE_PAUSED otherwise
    (the scheduler wakes the VM and asks again)."""
    if vm.live is not None:
        raise LivePaused(f"VM {vm.vm_id} is live-paused (by {vm.live.by}): resume it first")
