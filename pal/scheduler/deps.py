"""What the scheduler's operations work against: the store (rows and the event log), the
per-VM locks and in-flight counts, the node clients, the one transition function, the
settings and the clock. Every operation module (schedule.py, pause_resume.py, fork.py,
delete.py, exec_files.py, ...) takes a :class:`Deps` and the few other operations it calls,
never the Scheduler façade (scheduler.py), which only composes them.

Locking: besides the per-VM transition lock (transition.py), each multi-step operation on
a VM holds that VM's *operation* lock (:meth:`VmLocks.op_lock`) from its first check to its
last transition, so a concurrent exec waits for an in-progress idle pause and then resumes,
and two pauses cannot interleave. Store calls are synchronous and short (SQLite, WAL); they
run on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pal.config import Settings
from pal.errors import BackendError, NotFound, PalError
from pal.scheduler import nodes as nodes_mod
from pal.scheduler.liveview import LiveView
from pal.scheduler.nodes import NodePool
from pal.scheduler.states import holds_slot
from pal.scheduler.telemetry import Telemetry
from pal.scheduler.transition import Transitioner
from pal.store import Store, VmRecord
from pal.store.due import slot_rows
from pal.wire import verbs
from pal.wire.handlers import NodeCalls
from pal.wire.models import Empty, StopVm

log = logging.getLogger(__name__)


def new_vm_id() -> str:
    return "vm-" + uuid.uuid4().hex[:24]


def new_snapshot_id() -> str:
    return "snap-" + uuid.uuid4().hex[:24]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def as_pal(exc: BaseException) -> PalError:
    """A manager failure as a PalError: its own status if it has one, else 500."""
    if isinstance(exc, PalError):
        return exc
    return BackendError(f"{type(exc).__name__}: {exc}")


@dataclass
class VmLocks:
    """Each VM's operation lock, and its requests (exec, files, ports) in flight: the idle
    sweeper never suspends a VM with one in flight, whatever the (possibly stale) guest
    heartbeat says."""

    # Held weakly: a VM's lock lives while someone holds or awaits it, so the locks of the
    # VMs a long-lived server has seen do not pile up (a churn soak's finding).
    _ops: weakref.WeakValueDictionary[str, asyncio.Lock] = field(default_factory=weakref.WeakValueDictionary)
    inflight: dict[str, int] = field(default_factory=dict)

    def op_lock(self, vm_id: str) -> asyncio.Lock:
        return self._ops.setdefault(vm_id, asyncio.Lock())

    def locked_ids(self) -> set[str]:
        """The VMs that have an operation lock now (someone holds or awaits it)."""
        return set(self._ops)

    def busy(self, vm_id: str) -> bool:
        return self.inflight.get(vm_id, 0) > 0

    def enter(self, vm_id: str) -> None:
        self.inflight[vm_id] = self.inflight.get(vm_id, 0) + 1

    def leave(self, vm_id: str) -> None:
        n = self.inflight.get(vm_id, 1) - 1
        if n <= 0:
            self.inflight.pop(vm_id, None)
        else:
            self.inflight[vm_id] = n


# Runs a fire-and-forget node call in the background (:meth:`Chores.spawn`).
SpawnChore = Callable[[Coroutine[Any, Any, Any], str], None]


class Chores:
    """Fire-and-forget node calls (stray stops, a previous node letting go of a VM),
    cancelled when the scheduler closes."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def cancel_all(self) -> None:
        for t in list(self.tasks):
            t.cancel()


@dataclass(frozen=True)
class Deps:
    """The scheduler's shared parts, and the small reads every operation makes with them."""

    settings: Settings
    store: Store
    nodes: NodePool
    transitions: Transitioner
    locks: VmLocks
    telemetry: Telemetry
    clock: Callable[[], float]
    live: LiveView  # the leader's VMs that use a node (liveview.py)

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def own(self, tenant_id: str, vm_id: str) -> VmRecord:
        """The tenant's VM; 404 for a VM of another tenant as for a missing one."""
        vm = self.store.get_vm(vm_id)
        if vm is None or vm.tenant_id != tenant_id:
            raise NotFound(f"VM {vm_id} not found")
        return vm

    def reload(self, vm_id: str) -> VmRecord:
        vm = self.store.get_vm(vm_id)
        if vm is None:
            raise NotFound(f"VM {vm_id} not found")
        return vm

    def node(self, vm: VmRecord) -> NodeCalls:
        """The RPC client of the node the VM is placed on."""
        return self.nodes.client(vm.node_id)

    def occupying(self, node_id: str | None = None) -> list[VmRecord]:
        """The VMs that use a node (and a quota slot): the slot-holding states, and live
        pauses (their QEMU is still there). ``node_id``: of that node only. Read through
        the slot index: what runs, never the paused or terminated fleet."""
        rows = slot_rows(self.store, None if node_id is None else [node_id])
        return [v for v in rows if holds_slot(v.state, v.marker)]

    async def is_alive(self, vm: VmRecord, incarnation: int | None = None) -> bool | None:
        """Whether the VM's node reports it alive (None: the heartbeat itself failed)."""
        try:
            hb = await self.node(vm).call(verbs.HEARTBEAT, Empty())
        except Exception as exc:
            log.warning("heartbeat failed while checking %s: %s", vm.vm_id, exc)
            return None
        for a in hb.vms:
            if a.vm_id == vm.vm_id and a.alive:
                return incarnation is None or a.incarnation in (None, incarnation)
        return False

    async def stop_quietly(self, vm: VmRecord, node_id: str | None = None) -> bool:
        """Stop the VM's QEMU on ``node_id`` (default: its node). True if stopped, or if
        its node is lost (a lost node stops strays itself when it re-registers)."""
        node_id = node_id if node_id is not None else vm.node_id
        if self.nodes.state_of(node_id) == nodes_mod.LOST:
            return True
        try:
            await self.nodes.client(node_id).call(verbs.STOP, StopVm(vm_id=vm.vm_id))
            return True
        except Exception as exc:
            log.warning("stop of %s on %s failed: %s", vm.vm_id, node_id, exc)
            return False
