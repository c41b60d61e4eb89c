"""What each of the leader's loops acts on, each read through its own index so that a tick
costs what changed, not what the fleet holds (docs/scale.md):

- :func:`slot_rows`: the VMs that use a node (``holds_slot``: running, live-paused, in a
  transition), all or of some nodes (``ix_vms_slots``): the leader's live view, node loss;
- :func:`idle_due`: the VMs whose idle timeout has passed by their row (``ix_vms_idle_due``,
  ``ix_vms_idle_live_due``);
- :func:`slot_mismatches`: rows whose slot flag disagrees with their state;
- :func:`paused_page`: snapshot-paused VMs, a page at a time (the snapshot audit);
- :func:`vms_by_ids`: the rows a node's report or snapshot list names;
- :func:`unlist_terminated` and :func:`Store.prune_events`: retention.

The ``*_query`` functions build the statements (tests/unit/test_query_plans.py explains
each on a filled PostgreSQL and fails on a sequential scan of a large table).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime

from sqlalchemy import Select, bindparam, delete, or_, select, text, update

from pal.store.records import VmRecord
from pal.store.store import Store
from pal.store.tables import IDLE_DUE, IDLE_DUE_WHERE, IDLE_LIVE_DUE, IDLE_LIVE_DUE_WHERE, vm_tags, vms
from pal.store.write_tx import vm_from_row

ID_CHUNK = 100  # ids per IN (...) list: few enough that each is primary-key lookups at any size


def slot_rows_query(
    node_ids: Collection[str] | None = None, unplaced: bool = False
) -> Select[tuple[object, ...]]:
    q = select(vms).where(text("holds_slot"))  # the predicate of ix_vms_slots, word for word
    if node_ids is not None:
        placed = vms.c.node_id.in_(sorted(node_ids))
        q = q.where(or_(placed, vms.c.node_id.is_(None)) if unplaced else placed)
    return q


def slot_rows(
    store: Store, node_ids: Collection[str] | None = None, *, unplaced: bool = False
) -> list[VmRecord]:
    """The VMs holding a slot (on ``node_ids``, when given; with ``unplaced``, also those
    placed on no node: rows from before nodes existed, the embedded node's)."""
    if node_ids is not None and not node_ids and not unplaced:
        return []
    with store._read() as conn:
        return [vm_from_row(r) for r in conn.execute(slot_rows_query(node_ids, unplaced)).all()]


def idle_due_queries(now_ms: int, limit: int) -> list[Select[tuple[object, ...]]]:
    """One statement per tier (each reads its own partial index in due order)."""
    out = []
    for due, where in ((IDLE_DUE, IDLE_DUE_WHERE), (IDLE_LIVE_DUE, IDLE_LIVE_DUE_WHERE)):
        cond = text(f"{due} <= :now").bindparams(bindparam("now", now_ms))
        out.append(select(vms).where(text(where), cond).order_by(text(due)).limit(limit))
    return out


def idle_due(store: Store, now_ms: int, limit: int = 1000) -> list[VmRecord]:
    """The VMs the idle sweeper may take (running with an idle timeout, or live-paused by
    idle or wait with one) whose row says a timeout has passed by ``now_ms``, the most
    overdue first (``limit`` per tier: the rest are the next tick's)."""
    seen: dict[str, VmRecord] = {}
    with store._read() as conn:
        for q in idle_due_queries(now_ms, limit):
            for r in conn.execute(q).all():
                vm = vm_from_row(r)
                seen.setdefault(vm.vm_id, vm)
    return list(seen.values())


def slot_mismatch_queries(
    slot_states: Collection[str], live_markers: Collection[str]
) -> list[Select[tuple[object, ...]]]:
    states, markers = sorted(slot_states), sorted(live_markers)
    holding = or_(vms.c.state.in_(states), (vms.c.state == "paused") & vms.c.marker.in_(markers))
    return [
        select(vms).where(text("holds_slot"), ~holding),  # flag set, state holds none
        select(vms).where(vms.c.state.in_(states), ~vms.c.holds_slot),  # state holds one, no flag
        select(vms).where(vms.c.state == "paused", vms.c.marker.in_(markers), ~vms.c.holds_slot),
    ]


def slot_mismatches(
    store: Store, slot_states: Collection[str], live_markers: Collection[str]
) -> list[VmRecord]:
    """Rows whose ``holds_slot`` disagrees with their state (the scheduler's rule: states
    ``slot_states``, or paused with one of ``live_markers``)."""
    with store._read() as conn:
        return [
            vm_from_row(r) for q in slot_mismatch_queries(slot_states, live_markers) for r in conn.execute(q)
        ]


def paused_page_query(after: str, limit: int) -> Select[tuple[object, ...]]:
    q = select(vms).where(vms.c.state == "paused", vms.c.marker == "", vms.c.vm_id > after)
    return q.order_by(vms.c.state, vms.c.marker, vms.c.vm_id).limit(limit)


def paused_page(store: Store, after: str, limit: int) -> list[VmRecord]:
    """Snapshot-paused VMs by id after ``after`` (``ix_vms_state_marker``)."""
    with store._read() as conn:
        return [vm_from_row(r) for r in conn.execute(paused_page_query(after, limit)).all()]


def id_page(store: Store, after: str, limit: int) -> list[VmRecord]:
    """VMs by id after ``after`` (the primary key): a pass over every row, a page a tick."""
    with store._read() as conn:
        q = select(vms).where(vms.c.vm_id > after).order_by(vms.c.vm_id).limit(limit)
        return [vm_from_row(r) for r in conn.execute(q).all()]


def advance_activity(store: Store, vm_id: str, at_ms: int) -> bool:
    """Move the VM's host-observed last activity forward to ``at_ms`` (never back)."""
    with store.write() as tx:
        q = update(vms).where(vms.c.vm_id == vm_id, vms.c.last_activity_unix_ms < at_ms)
        return tx._conn.execute(q.values(last_activity_unix_ms=at_ms)).rowcount == 1


def vms_by_ids(store: Store, ids: Iterable[str]) -> dict[str, VmRecord]:
    """The rows of ``ids`` that exist, by id (primary key lookups, in chunks)."""
    wanted = sorted(set(ids))
    out: dict[str, VmRecord] = {}
    with store._read() as conn:
        for i in range(0, len(wanted), ID_CHUNK):
            for r in conn.execute(select(vms).where(vms.c.vm_id.in_(wanted[i : i + ID_CHUNK]))).all():
                vm = vm_from_row(r)
                out[vm.vm_id] = vm
    return out


def mapped_by_children(store: Store, parent_ids: Iterable[str], never_starts: Collection[str]) -> set[str]:
    """The snapshots the fork children of ``parent_ids`` map (``ix_vms_parent``), those
    that may still start (not in ``never_starts``)."""
    wanted = sorted(set(parent_ids))
    out: set[str] = set()
    with store._read() as conn:
        for i in range(0, len(wanted), ID_CHUNK):
            q = select(vms.c.mem_snapshot_id, vms.c.state).where(
                vms.c.parent_vm_id.in_(wanted[i : i + ID_CHUNK]), vms.c.mem_snapshot_id.is_not(None)
            )
            out |= {str(m) for m, st in conn.execute(q).all() if st not in never_starts}
    return out


def unlist_query(before: datetime, limit: int) -> Select[tuple[object, ...]]:
    q = select(vms.c.vm_id).where(text("listed AND state = 'terminated'"), vms.c.updated_at < before)
    return q.order_by(vms.c.updated_at).limit(limit)


def unlist_terminated(store: Store, before: datetime, limit: int) -> int:
    """Take VMs terminated before ``before`` out of their tenant's list (and their metadata
    out of its filter), at most ``limit``: the number taken (leader only: fenced)."""
    with store.write() as tx:
        ids = [r[0] for r in tx._conn.execute(unlist_query(before, limit)).all()]
        if ids:
            tx._conn.execute(update(vms).where(vms.c.vm_id.in_(ids)).values(listed=False))
            tx._conn.execute(delete(vm_tags).where(vm_tags.c.vm_id.in_(ids)))
    return len(ids)
