"""THE sandbox state machine: seven states and every allowed transition, in one table.

Nothing else in Pal decides whether a state change is legal. The scheduler's single
``transition()`` function consults :func:`check` under the per-VM lock before it persists a
new state, its marker and a status event.

The spec's transitions (microvm-lifecycle.txt, "Transitions") are marked ``spec``; Pal adds
a few the spec leaves implicit (deleting a paused or failed VM, a running VM whose QEMU
died, reconciliation after a crash), marked ``pal``.
"""

from __future__ import annotations

from enum import StrEnum


class VmState(StrEnum):
    PENDING = "pending"
    SPAWNING = "spawning"
    RUNNING = "running"
    DRAINING = "draining"
    PAUSED = "paused"
    FAILED = "failed"
    TERMINATED = "terminated"


class Marker(StrEnum):
    """What an in-between state is in the middle of; persisted with the state so a
    restarted control plane knows how to finish or roll back (reconcile.py)."""

    NONE = ""
    PAUSING = "scheduler:pausing"
    IDLE_PAUSING = "scheduler:idle-pausing"
    RESUMING = "scheduler:resuming"
    DELETING = "scheduler:deleting"
    SPAWNING = "scheduler:spawning"
    FORKING = "scheduler:forking"


# Pseudo-state for "the VM does not exist yet".
START = None

S = VmState

# (from, to) -> trigger. The only place transitions are defined.
TRANSITIONS: dict[tuple[VmState | None, VmState], str] = {
    # spec
    (START, S.PENDING): "POST /v1/runtime/schedule",
    (S.PENDING, S.SPAWNING): "placed on a node",
    (S.SPAWNING, S.RUNNING): "first harness heartbeat",
    (S.SPAWNING, S.FAILED): "spawn fails",
    (S.RUNNING, S.DRAINING): "pause, idle timeout or delete",
    (S.DRAINING, S.PAUSED): "snapshot and stop succeeded",
    (S.DRAINING, S.RUNNING): "stop failed; the VM keeps its slot",
    (S.DRAINING, S.TERMINATED): "drained after delete",
    (S.PAUSED, S.SPAWNING): "resume or auto-resume",
    (S.SPAWNING, S.PAUSED): "restore failed; resumable again",
    (START, S.SPAWNING): "fork x N (children)",
    # pal
    (S.PENDING, S.FAILED): "placement failed (no node, no image)",
    (S.PENDING, S.TERMINATED): "deleted before placement",
    (S.RUNNING, S.FAILED): "QEMU exited or the harness went silent",
    (S.DRAINING, S.FAILED): "pause found the VM dead with no complete snapshot",
    (S.PAUSED, S.DRAINING): "delete of a paused VM (snapshots released)",
    (S.PAUSED, S.FAILED): "its snapshot is gone or corrupt (reconciliation)",
    (S.FAILED, S.DRAINING): "delete of a failed VM",
    (S.SPAWNING, S.DRAINING): "delete during spawn",
}

# States that hold a concurrent-VM quota slot (quotas.py keeps the books).
SLOT_HOLDING = frozenset({S.PENDING, S.SPAWNING, S.RUNNING, S.DRAINING})
# States in which the VM may be a live QEMU process on some node.
LIVE = frozenset({S.SPAWNING, S.RUNNING, S.DRAINING})
FINAL = frozenset({S.TERMINATED})


class IllegalTransition(Exception):
    """A transition the table does not allow (answered 409 by the API)."""

    def __init__(self, vm_id: str, frm: VmState | None, to: VmState) -> None:
        self.vm_id = vm_id
        self.frm = frm
        self.to = to
        shown = frm.value if frm is not None else "start"
        super().__init__(f"VM {vm_id} cannot go from {shown} to {to.value}")


def is_allowed(frm: VmState | None, to: VmState) -> bool:
    return (frm, to) in TRANSITIONS


def check(vm_id: str, frm: VmState | None, to: VmState) -> str:
    """Return the transition's trigger, or raise :class:`IllegalTransition`."""
    try:
        return TRANSITIONS[(frm, to)]
    except KeyError:
        raise IllegalTransition(vm_id, frm, to) from None


def allowed_from(frm: VmState | None) -> set[VmState]:
    return {to for (f, to) in TRANSITIONS if f == frm}
