"""What the control plane keeps so that it never reads the fleet (docs/scale.md), checked
against the rows it stands for after a run of every operation: each tenant's running
quota counts (pal/store/books.py), the leader's live view (pal/scheduler/liveview.py),
the schedules of one tenant written together; and retention (pal/scheduler/retention.py)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from pal.errors import QuotaExceeded
from pal.scheduler.liveview import LiveView
from pal.spec import AgentSpec, PauseRequest
from pal.store import Store, utcnow
from pal.store import books as books_mod
from pal.store.tables import tenants
from tests.fakes import SchedEnv, make_env


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=8)


async def _running(env: SchedEnv, **spec: object) -> str:
    return (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate(spec)))[0].vm_id


def _counts(store: Store) -> dict[str, tuple[int, int, int]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(tenants.c.id, tenants.c.slots_used, tenants.c.paused_vms, tenants.c.snapshot_bytes_used)
        )
        return {r[0]: (r[1], r[2], r[3]) for r in rows}


async def _every_operation(env: SchedEnv) -> None:
    s, t = env.sched, env.tenant_id
    a, b, c = await _running(env), await _running(env), await _running(env, metadata={"team": "x"})
    await s.pauses.pause(t, a)
    await s.pauses.pause(t, b, PauseRequest.model_validate({"mode": "live"}))
    await s.pauses.resume(t, b)
    forked = await s.forking.fork(t, c, 2)
    await s.deleting.delete(t, forked.forks[0].vm_id)
    await s.pauses.resume(t, a)
    await s.pauses.pause(t, a)
    await s.deleting.delete(t, c)
    env.manager.kill(b)
    await s.reconciler.reconcile_light()  # b fails: its slot goes


async def test_the_tenants_books_and_the_live_view_agree_with_the_rows(env: SchedEnv) -> None:
    env.sched.live_view.load()
    await _every_operation(env)
    kept = _counts(env.store)
    with env.store.engine.begin() as conn:  # recounted from the rows themselves
        books_mod.recount(conn)
    assert _counts(env.store) == kept
    # a paused, b failed, c deleted with one of its fork children: the other child runs
    assert kept[env.tenant_id][:2] == (1, 1) and env.store.count_slots(env.tenant_id) == 1
    fresh = LiveView(env.store)
    fresh.load()
    assert {k: (v.node_id, v.state, v.marker, v.incarnation) for k, v in env.sched.live_view.vms.items()} == {
        k: (v.node_id, v.state, v.marker, v.incarnation) for k, v in fresh.vms.items()
    }
    assert env.sched.live_view.loads() == fresh.loads()


async def test_concurrent_schedules_of_a_tenant_take_exactly_its_slots(env: SchedEnv) -> None:
    """Written together (one transaction while the previous commits), the schedules of one
    tenant still never overbook: 12 at once against max_vms=8 is 8 running and 4 refused."""
    got = await asyncio.gather(
        *(env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate({})) for _ in range(12)),
        return_exceptions=True,
    )
    assert sum(isinstance(g, QuotaExceeded) for g in got) == 4
    assert sum(not isinstance(g, BaseException) for g in got) == 8
    assert env.store.count_slots(env.tenant_id) == 8 == _counts(env.store)[env.tenant_id][0]


async def test_retention_unlists_terminated_vms_after_an_hour_and_drops_old_events(env: SchedEnv) -> None:
    old, kept = await _running(env), await _running(env)
    await env.sched.deleting.delete(env.tenant_id, old)
    with env.store.write() as tx:
        tx._conn.exec_driver_sql(
            "UPDATE vms SET updated_at = ? WHERE vm_id = ?",
            ((utcnow() - timedelta(hours=2)).replace(tzinfo=None).isoformat(" "), old),
        )
        tx.add_event(kept, env.tenant_id, "mcp_tool", at=utcnow() - timedelta(days=400))
    events_before = len(env.store.list_events(kept))
    assert await env.sched.retention.sweep() == {"unlisted": 1, "events": 1}
    assert [v.vm_id for v in await env.sched.reads.list_vms(env.tenant_id)] == [kept]
    assert await env.sched.listing.vms(
        env.tenant_id, after=None, limit=10, metadata={}
    ) == await env.sched.reads.list_vms(env.tenant_id)
    assert len(env.store.list_events(kept)) == events_before - 1
    assert (await env.sched.reads.get(env.tenant_id, old)).state == "terminated"  # the row stays
    assert await env.sched.retention.sweep() == {"unlisted": 0, "events": 0}


def test_prune_events_by_kind_leaves_the_others(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'pal.db'}")
    tenant, _ = store.create_tenant("acme", 5)
    long_ago = utcnow() - timedelta(days=30)
    for kind in ("status", "mcp_tool", "mcp_tool"):
        store.add_event("vm-1", tenant.id, kind, at=long_ago)
    store.add_event("vm-1", tenant.id, "mcp_tool")  # recent: kept
    assert store.prune_events(utcnow() - timedelta(days=1), 1, kinds={"mcp_tool"}) == 1  # a page of one
    assert store.prune_events(utcnow() - timedelta(days=1), 100, kinds={"mcp_tool"}) == 1
    assert sorted(e.kind for e in store.list_events("vm-1")) == ["mcp_tool", "status"]
