"""THE sandbox state machine: seven states, the named actions that move a VM between them,
and every allowed move, in one table.

Nothing else in Pal decides whether an operation may run in a VM's current state. Each
scheduler operation names its :class:`Action` and checks it here (:func:`check`) before any
work; the one transition function (``transition.py``) checks it again under the per-VM lock
and persists the state, marker and a status event. Like cloud-hypervisor's
``VmState::valid_transition``, but keyed by named actions (E2B's state actions): two actions
may share an edge (pause and delete both leave ``running`` for ``draining``) and differ in
the marker they leave, and an action that finishes an in-between state names the markers it
may finish (only a pause's ``draining`` may end ``paused``).

The reference lifecycle's transitions (its "Transitions" table) are marked ``spec``; Pal adds
a few the spec leaves implicit (deleting a paused or failed VM, a running VM whose QEMU
died, reconciliation after a crash), marked ``pal``.

Two kinds of pause share the state ``paused`` and differ by marker: a *snapshot* pause
(marker none: QEMU gone, memory and disk in a snapshot, no slot) and a *live* pause
(docs/live-pause.md: the same QEMU with its vCPUs stopped, RAM resident or
offloaded; markers ``live:*`` say who paused it). A live-paused VM still occupies its
node, so it holds its quota slot (:func:`holds_slot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pal.errors import Conflict


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
    # On PAUSED: a live pause (QEMU kept, vCPUs stopped), and by whom. Only the automatic
    # ones (idle, wait) are woken by an exec, a file or port request, data or a timer.
    LIVE = "live:operator"
    LIVE_IDLE = "live:idle"  # the idle sweeper's first tier (idleLivePauseSecs)
    LIVE_WAIT = "live:wait"  # wait management: the guest waits on I/O the gateway holds


class Action(StrEnum):
    """What an operation does to a VM. Every state change names one."""

    SCHEDULE = "schedule"
    PLACE = "place"
    FORK = "fork"  # creates a child
    COME_UP = "come up"
    FAIL_SPAWN = "fail spawn"
    PAUSE = "pause"
    IDLE_PAUSE = "idle pause"
    FINISH_PAUSE = "finish pause"
    ROLL_BACK_PAUSE = "roll back pause"
    RESUME = "resume"
    ROLL_BACK_RESUME = "roll back resume"
    DELETE = "delete"
    FINISH_DELETE = "finish delete"
    LIVE_PAUSE = "live pause"  # the operator's (POST pause {"mode": "live"})
    IDLE_LIVE_PAUSE = "idle live pause"
    WAIT_PAUSE = "wait pause"
    LIVE_RESUME = "live resume"  # the same QEMU continues (operator, or a wake)
    LOSE = "lose"  # the VM is gone (QEMU died, harness silent, snapshot missing)
    # Its QEMU is gone (not adopted after a restart) but a complete snapshot of it is not:
    # paused from that snapshot, resumable, never failed (reconcile.py).
    RECOVER = "recover"
    # Actions that need a state and leave it as it is.
    EXEC = "exec"  # exec and file requests
    FORK_FROM = "fork from"  # the source of a fork
    SET_EGRESS = "set egress"  # running: applied at once; paused: at the next resume
    SET_SECRET = "set secret"  # a brokered secret's value: the same


# Pseudo-state for "the VM does not exist yet".
START = None

S = VmState
A = Action
M = Marker
PAUSE_MARKERS = frozenset({M.PAUSING, M.IDLE_PAUSING})
LIVE_MARKERS = frozenset({M.LIVE, M.LIVE_IDLE, M.LIVE_WAIT})
AUTO_LIVE_MARKERS = frozenset({M.LIVE_IDLE, M.LIVE_WAIT})  # woken on demand
SNAPSHOT_PAUSED = frozenset({M.NONE})  # a paused VM with no live marker has a snapshot


@dataclass(frozen=True)
class Rule:
    frm: VmState | None
    action: Action
    to: VmState
    trigger: str
    origin: str = "pal"  # "spec": the lifecycle spec's table; "pal": added by Pal
    marker: Marker = M.NONE  # the marker the VM carries in ``to``
    # For an action that finishes an in-between state: the markers it may finish.
    during: frozenset[Marker] | None = None


def _spec(frm: VmState | None, action: Action, to: VmState, trigger: str, **kw: object) -> Rule:
    return Rule(frm, action, to, trigger, "spec", **kw)  # type: ignore[arg-type]


# The only place transitions are defined.
RULES: tuple[Rule, ...] = (
    # spec
    _spec(START, A.SCHEDULE, S.PENDING, "POST /v1/runtime/schedule"),
    _spec(S.PENDING, A.PLACE, S.SPAWNING, "placed on a node", marker=M.SPAWNING),
    _spec(S.SPAWNING, A.COME_UP, S.RUNNING, "first harness heartbeat"),
    _spec(S.SPAWNING, A.FAIL_SPAWN, S.FAILED, "spawn fails", during=frozenset({M.SPAWNING, M.FORKING})),
    _spec(S.RUNNING, A.PAUSE, S.DRAINING, "pause", marker=M.PAUSING),
    _spec(S.RUNNING, A.IDLE_PAUSE, S.DRAINING, "idle timeout or server shutdown", marker=M.IDLE_PAUSING),
    _spec(S.RUNNING, A.DELETE, S.DRAINING, "delete", marker=M.DELETING),
    _spec(S.DRAINING, A.FINISH_PAUSE, S.PAUSED, "snapshot and stop succeeded", during=PAUSE_MARKERS),
    _spec(
        S.DRAINING,
        A.ROLL_BACK_PAUSE,
        S.RUNNING,
        "stop failed; the VM keeps its slot",
        during=PAUSE_MARKERS,
    ),
    _spec(S.DRAINING, A.FINISH_DELETE, S.TERMINATED, "drained after delete", during=frozenset({M.DELETING})),
    _spec(S.PAUSED, A.RESUME, S.SPAWNING, "resume or auto-resume", marker=M.RESUMING, during=SNAPSHOT_PAUSED),
    _spec(
        S.SPAWNING,
        A.ROLL_BACK_RESUME,
        S.PAUSED,
        "restore failed; resumable again",
        during=frozenset({M.RESUMING}),
    ),
    _spec(START, A.FORK, S.SPAWNING, "fork x N (children)", marker=M.FORKING),
    # pal
    Rule(S.PENDING, A.FAIL_SPAWN, S.FAILED, "placement failed (no node, no image)"),
    Rule(S.PENDING, A.DELETE, S.TERMINATED, "deleted before placement"),
    Rule(S.RUNNING, A.LOSE, S.FAILED, "QEMU exited, the harness went silent, or its node was lost"),
    Rule(S.SPAWNING, A.LOSE, S.FAILED, "its node was lost during a spawn, resume or fork"),
    Rule(
        S.DRAINING,
        A.LOSE,
        S.FAILED,
        "pause found the VM dead with no complete snapshot",
        during=PAUSE_MARKERS,
    ),
    Rule(S.PAUSED, A.DELETE, S.DRAINING, "delete of a paused VM (snapshots released)", marker=M.DELETING),
    Rule(S.PAUSED, A.LOSE, S.FAILED, "its snapshot is gone or corrupt (reconciliation)"),
    Rule(
        S.RUNNING,
        A.RECOVER,
        S.PAUSED,
        "its QEMU could not be adopted after a restart: paused from its newest complete snapshot",
    ),
    Rule(
        S.PAUSED,
        A.RECOVER,
        S.PAUSED,
        "a live-paused VM whose QEMU could not be adopted: paused from its newest complete snapshot",
        during=LIVE_MARKERS,
    ),
    Rule(S.FAILED, A.DELETE, S.DRAINING, "delete of a failed VM", marker=M.DELETING),
    Rule(S.SPAWNING, A.DELETE, S.DRAINING, "delete during spawn", marker=M.DELETING),
    # live pause (docs/live-pause.md): same QEMU, vCPUs stopped; no in-between state,
    # the node records each live pause in the VM's state.json and reconciliation takes the
    # node's word (reconcile.py)
    _spec(S.RUNNING, A.LIVE_PAUSE, S.PAUSED, "pause {mode: live}", marker=M.LIVE),
    _spec(S.RUNNING, A.IDLE_LIVE_PAUSE, S.PAUSED, "idle for idleLivePauseSecs", marker=M.LIVE_IDLE),
    _spec(S.RUNNING, A.WAIT_PAUSE, S.PAUSED, "idle guest waiting on held I/O", marker=M.LIVE_WAIT),
    _spec(
        S.PAUSED,
        A.LIVE_RESUME,
        S.RUNNING,
        "resume, or a wake (data, timer, exec, file, port)",
        during=LIVE_MARKERS,
    ),
    Rule(
        S.PAUSED,
        A.LIVE_PAUSE,
        S.PAUSED,
        "the operator takes over an automatic live pause (or offloads one)",
        marker=M.LIVE,
        during=LIVE_MARKERS,
    ),
    Rule(
        S.PAUSED,
        A.PAUSE,
        S.DRAINING,
        "snapshot pause of a live-paused VM",
        marker=M.PAUSING,
        during=LIVE_MARKERS,
    ),
    Rule(
        S.PAUSED,
        A.IDLE_PAUSE,
        S.DRAINING,
        "idleTimeoutSecs: an automatic live pause (the idle tier, or a wait that never "
        "ends) becomes a snapshot (or server shutdown)",
        marker=M.IDLE_PAUSING,
        during=AUTO_LIVE_MARKERS,
    ),
)

# Actions that need a state and leave it unchanged.
STAYS: dict[Action, frozenset[VmState]] = {
    A.EXEC: frozenset({S.RUNNING}),
    A.FORK_FROM: frozenset({S.RUNNING, S.PAUSED}),
    A.SET_EGRESS: frozenset({S.RUNNING, S.PAUSED}),
    A.SET_SECRET: frozenset({S.RUNNING, S.PAUSED}),
}

_BY_KEY: dict[tuple[VmState | None, Action], Rule] = {(r.frm, r.action): r for r in RULES}
assert len(_BY_KEY) == len(RULES), "one rule per (state, action)"

# States that hold a concurrent-VM quota slot (quotas.py keeps the books), and the one
# rule beyond them: a live-paused VM still occupies its node (its QEMU, its memory until
# offloaded, its network), so it keeps its slot; a snapshot pause frees it.
SLOT_HOLDING = frozenset({S.PENDING, S.SPAWNING, S.RUNNING, S.DRAINING})
FINAL = frozenset({S.TERMINATED})
# States a VM never starts from again (a failed VM can only be deleted): a fork snapshot is
# kept for the children that may still map it, never for these (delete, retention, sweep).
NEVER_STARTS = frozenset({S.FAILED, S.TERMINATED})


def holds_slot(state: VmState | str, marker: str = "") -> bool:
    """Whether a VM in ``state`` carrying ``marker`` holds a quota slot."""
    st = VmState(state)
    return st in SLOT_HOLDING or (st == S.PAUSED and marker in LIVE_MARKERS)


def is_live_paused(state: VmState | str, marker: str = "") -> bool:
    return VmState(state) == S.PAUSED and marker in LIVE_MARKERS


def has_live_qemu(state: VmState | str, marker: str = "") -> bool:
    """Whether a VM in ``state`` carrying ``marker`` has a live QEMU on its node: running,
    or live-paused (vCPUs stopped). The one rule for "ask the node, not the row": egress
    and secret changes apply at once, a fork snapshots it, a drain suspends it, its
    counters are the node's, reconciliation checks its QEMU."""
    return VmState(state) == S.RUNNING or is_live_paused(state, marker)


class IllegalTransition(Conflict):
    """An action the table does not allow in the VM's state (409)."""

    def __init__(
        self, vm_id: str, frm: VmState | None, action: Action, marker: str = "", hint: str | None = None
    ) -> None:
        self.vm_id = vm_id
        self.frm = frm
        self.action = action
        shown = "not created yet" if frm is None else frm.value + (f" ({marker})" if marker else "")
        super().__init__(
            hint or f"VM {vm_id} is {shown}: cannot {action.value} (allowed when {_where(action)})"
        )


def _where(action: Action) -> str:
    """Where ``action`` is allowed, in words: `running`, `paused (live:idle, live:wait)`."""
    if action in STAYS:
        return ", ".join(sorted(s.value for s in STAYS[action]))
    out = set()
    for r in RULES:
        if r.action != action:
            continue
        name = r.frm.value if r.frm else "start"
        # A paused VM's marker says which kind of pause it is in.
        if r.frm == S.PAUSED and r.during is not None:
            if r.during == SNAPSHOT_PAUSED:
                name = "paused (snapshot)"
            elif r.during == LIVE_MARKERS:
                name = "live-paused"
            else:
                name = "live-paused by " + " or ".join(sorted(m.value.split(":")[-1] for m in r.during))
        out.add(name)
    return ", ".join(sorted(out))


def rule(frm: VmState | None, action: Action, marker: str = "") -> Rule | None:
    """The rule for ``action`` from ``frm`` carrying ``marker``, or None if not allowed."""
    r = _BY_KEY.get((frm, action))
    if r is None or (r.during is not None and marker not in r.during):
        return None
    return r


def allowed(frm: VmState | None, action: Action, marker: str = "") -> bool:
    if action in STAYS:
        return frm in STAYS[action]
    return rule(frm, action, marker) is not None


def check(
    vm_id: str, frm: VmState | str | None, action: Action, marker: str = "", *, hint: str | None = None
) -> VmState:
    """The state ``action`` leads to (its own for actions that keep it), or raise
    :class:`IllegalTransition`."""
    state = VmState(frm) if frm is not None else None
    if action in STAYS:
        if state in STAYS[action]:
            assert state is not None
            return state
        raise IllegalTransition(vm_id, state, action, marker, hint)
    r = rule(state, action, marker)
    if r is None:
        raise IllegalTransition(vm_id, state, action, marker, hint)
    return r.to
