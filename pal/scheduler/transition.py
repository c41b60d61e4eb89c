"""The ONE way a VM's lifecycle columns change (and the one way a VM row is created).

Takes the per-VM lock, checks the named action against the table in states.py, persists
state + marker + reason (and any columns that must change atomically with it), appends a
status event and keeps the quota books through quotas.py: a VM entering a slot-holding
state reserves its slot (402 changes nothing), one leaving them releases it. All in one
write transaction, so a crash can never leave a state without its event or its slot books.

The store refuses lifecycle columns (``store.LIFECYCLE_COLUMNS``) from any other writer;
tests/unit/test_lifecycle_writes.py proves nothing else writes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pal.errors import NotFound, QuotaExceeded, public_message
from pal.scheduler import quotas, states
from pal.scheduler.states import START, Action, IllegalTransition, VmState, holds_slot
from pal.store import Store, VmRecord, WriteTx

STATUS_EVENT = "status"
T = TypeVar("T")
# The threads transitions commit on: as many as commits worth waiting for together (the
# database groups the commits that arrive together; the default pool has 6 on 2 cores).
_WRITERS = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="pal-transition")
# One create waiting for its tenant's next transaction: its rows, the snapshot bytes it
# needs (a fork), and the future its caller awaits.
_Create = tuple[Sequence[VmRecord], int, "asyncio.Future[None]"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Audit:
    """An audit event that comes with a transition, in its transaction: whoever sees the
    VM's new state sees this event too (a lifetime's end: lifetime.py)."""

    kind: str
    reason: str | None = None
    details: dict[str, Any] | None = None
    # the state the story began in (a lifetime's end is told from ``running``, not from the
    # ``draining`` its last transition leaves); None: the transition's own from-state
    from_state: str | None = None


def _public_reason(vm_id: str, reason: str | None) -> str | None:
    """A reason is shown to the tenant (GET vm, events): no host paths or QEMU output in
    it (errors.public_message); the full text goes to the log."""
    if reason is None:
        return None
    shown = public_message(reason)
    if shown != reason:
        log.info("VM %s: %s", vm_id, reason)
    return shown


class Transitioner:
    """``on_change``: told each row as a committed transaction left it (the leader's live
    view, liveview.py, follows the store through it)."""

    def __init__(self, store: Store, on_change: Callable[[VmRecord], None] | None = None) -> None:
        self._store = store
        self._on_change = on_change or (lambda _vm: None)
        # Weakly held, like the scheduler's operation locks: one per VM in use, not per VM ever.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._creating: dict[str, list[_Create]] = {}  # tenant id -> creates waiting
        self._writing: set[str] = set()  # tenants whose creates are being written

    def lock(self, vm_id: str) -> asyncio.Lock:
        return self._locks.setdefault(vm_id, asyncio.Lock())

    async def create(
        self,
        tenant_id: str,
        rows: Sequence[VmRecord],
        action: Action,
        *,
        reason: str | None = None,
        reasons: Sequence[str] | None = None,
        new_snapshot_bytes: int = 0,
    ) -> None:
        """Insert new VM rows (START -> the action's state), reserving one slot each, all or
        nothing (402 inserts nothing). ``reasons``: one per row instead of ``reason``.
        ``new_snapshot_bytes``: a snapshot about that big is about to be taken for them
        (a fork of a running VM): checked against the tenant's snapshot limit too."""
        for i, row in enumerate(rows):
            rule = states.rule(START, action)
            if rule is None:
                raise IllegalTransition(row.vm_id, START, action)
            row.state, row.marker = rule.to.value, rule.marker.value
            row.reason = _public_reason(row.vm_id, reasons[i] if reasons is not None else reason)

        got: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._creating.setdefault(tenant_id, []).append((rows, new_snapshot_bytes, got))
        if tenant_id not in self._writing:
            self._writing.add(tenant_id)
            asyncio.get_running_loop().create_task(self._write_creates(tenant_id))
        await got
        for row in rows:
            self._on_change(row)

    async def _write_creates(self, tenant_id: str) -> None:
        """The creates of one tenant, those waiting written together in one transaction
        (each reserving its slots under the tenant's lock): while one commits, the next
        ones gather. One tenant's creates serialise on its quota either way; this makes
        them share the lock and the commit instead of queueing for both one by one."""
        try:
            while batch := self._creating.pop(tenant_id, None):
                try:
                    refused = await self._in_tx(
                        functools.partial(self._create_in, tenant_id=tenant_id, batch=batch)
                    )
                except BaseException as exc:
                    refused = {id(f): exc for _, _, f in batch}
                for _, _, fut in batch:
                    if fut.done():
                        continue
                    err = refused.get(id(fut))
                    if err is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(err)
        finally:
            self._writing.discard(tenant_id)

    @staticmethod
    def _create_in(tx: WriteTx, *, tenant_id: str, batch: list[_Create]) -> dict[int, BaseException]:
        """Each create of ``batch`` that fits the tenant's quotas, in order; those that do
        not are refused alone (the checks change nothing before they pass)."""
        refused: dict[int, BaseException] = {}
        for rows, new_snapshot_bytes, fut in batch:
            try:
                if new_snapshot_bytes:
                    quotas.check_snapshot_bytes_in(tx, tenant_id, new_snapshot_bytes)
                quotas.reserve_in(tx, tenant_id, new_vms=rows)
            except (QuotaExceeded, NotFound) as exc:
                refused[id(fut)] = exc
                continue
            for row in rows:
                tx.add_event(
                    row.vm_id,
                    tenant_id,
                    STATUS_EVENT,
                    to_state=row.state,
                    marker=row.marker,
                    reason=row.reason,
                )
        return refused

    async def transition(
        self,
        vm_id: str,
        action: Action,
        *,
        reason: str | None = None,
        new_snapshot_bytes: int = 0,
        tenant_limits: bool = True,
        details: dict[str, Any] | None = None,
        audit: Audit | None = None,
        **fields: Any,
    ) -> VmRecord:
        """Apply ``action`` to ``vm_id``: 409 (:class:`IllegalTransition`) unless the table
        allows it in the VM's current state and marker; 402 if it needs a slot the tenant
        does not have, or (a pause) goes past the tenant's paused-VM or snapshot limits
        (``new_snapshot_bytes``: about how big the snapshot it takes will be).
        ``tenant_limits=False`` skips the latter two: a server shutdown suspends every VM,
        whatever the limits, rather than lose one. ``fields`` are other columns that
        change with the state; ``details`` go with its status event (e.g. a spawn's timings);
        ``audit``: an event written with it (after the status event, in its transaction)."""

        def write(tx: WriteTx) -> VmRecord:
            if tenant_limits and action in (Action.PAUSE, Action.IDLE_PAUSE):
                vm = tx.get_vm(vm_id)
                if vm is not None and states.rule(VmState(vm.state), action, vm.marker) is not None:
                    quotas.check_pause_in(tx, vm)
                    quotas.check_snapshot_bytes_in(tx, vm.tenant_id, new_snapshot_bytes)
            return self._apply(tx, vm_id, action, reason, fields, details, audit)

        async with self.lock(vm_id):
            after = await self._in_tx(write)
            self._on_change(after)
            return after

    async def transition_all(
        self, changes: Sequence[tuple[str, dict[str, Any]]], action: Action, *, reason: str | None = None
    ) -> list[VmRecord]:
        """Apply ``action`` to several VMs in ONE transaction: all of them change or none
        (a fork's children come up together, so a crash never leaves half a fork). A
        ``details`` entry of a VM's fields goes with its status event."""
        ids = sorted({vm_id for vm_id, _ in changes})
        async with contextlib.AsyncExitStack() as stack:
            for vm_id in ids:  # always in the same order: no deadlock between two callers
                await stack.enter_async_context(self.lock(vm_id))

            def write(tx: WriteTx) -> list[VmRecord]:
                out = []
                for vm_id, fields in changes:
                    cols = dict(fields)
                    details = cols.pop("details", None)
                    out.append(self._apply(tx, vm_id, action, reason, cols, details))
                return out

            out = await self._in_tx(write)
            for vm in out:
                self._on_change(vm)
            return out

    async def _in_tx(self, work: Callable[[WriteTx], T]) -> T:
        """``work`` in one write transaction, on a worker thread: the commit waits for the
        database's disk, and the event loop serves everything else meanwhile (at a few
        hundred transitions a second, commits made one after another on the loop were
        what held the leader: docs/scale.md). The VM's lock is held by the caller."""

        def run() -> T:
            with self._store.write() as tx:
                return work(tx)

        # copy_context: the caller's counting (pal/store/counting.py) follows it there
        return await asyncio.get_running_loop().run_in_executor(_WRITERS, contextvars.copy_context().run, run)

    @staticmethod
    def _apply(
        tx: WriteTx,
        vm_id: str,
        action: Action,
        reason: str | None,
        fields: dict[str, Any],
        details: dict[str, Any] | None = None,
        audit: Audit | None = None,
    ) -> VmRecord:
        vm = tx.get_vm(vm_id)
        if vm is None:
            raise NotFound(f"VM {vm_id} not found")
        reason = _public_reason(vm_id, reason)
        frm = VmState(vm.state)
        rule = states.rule(frm, action, vm.marker)
        if rule is None:
            raise IllegalTransition(vm_id, frm, action, vm.marker)
        holds = holds_slot(rule.to, rule.marker)  # a live pause keeps its slot (states.py)
        if holds and not holds_slot(frm, vm.marker):
            quotas.reserve_in(tx, vm.tenant_id, existing=[vm_id])
        after = tx.write_lifecycle(
            vm_id,
            expect_state=frm.value,
            before=vm,
            state=rule.to.value,
            marker=rule.marker.value,
            reason=reason,
            **fields,
        )
        if after is None:  # cannot happen under the row lock; refuse rather than log a false event
            raise IllegalTransition(vm_id, frm, action, vm.marker, "VM changed state meanwhile")
        tx.add_event(
            vm_id,
            vm.tenant_id,
            STATUS_EVENT,
            from_state=frm.value,
            to_state=rule.to.value,
            marker=rule.marker.value,
            reason=reason,
            details=details,
        )
        if audit is not None:
            tx.add_event(
                vm_id,
                vm.tenant_id,
                audit.kind,
                from_state=audit.from_state or frm.value,
                reason=audit.reason,
                details=audit.details,
            )
        if not holds and quotas.release_in(tx, vm_id):
            after.holds_slot = False
        return after

    async def repair_slot(self, vm_id: str) -> bool:
        """Reconciliation only: make the slot flag agree with the VM's state, quota or not
        (a VM found in a slot-holding state after a crash really uses a node). True if the
        flag changed."""

        def write(tx: WriteTx) -> tuple[bool, VmRecord | None]:
            vm = tx.get_vm(vm_id)
            if vm is None:
                return False, None
            changed = quotas.force_in(tx, vm_id, holds_slot(vm.state, vm.marker))
            return changed, tx.get_vm(vm_id)

        async with self.lock(vm_id):
            changed, after = await self._in_tx(write)
            if after is not None:
                self._on_change(after)
            return changed
