"""Leadership on PostgreSQL: one lease holder at a time, takeover only after expiry, and
fencing: every write of a deposed leader fails, even one already under way."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import text, update

from pal.errors import NotLeader
from pal.scheduler.leader import LeaseLeader
from pal.scheduler.states import Action
from pal.scheduler.transition import Transitioner
from pal.store import Store, VmRecord
from pal.store.tables import leader_lease
from pal_tools.localcluster.postgres import LocalPostgres


@pytest.fixture
def url(postgres: LocalPostgres) -> str:
    return postgres.new_database()


def _expire(store: Store) -> None:
    """The leader's lease runs out (as after a kill -9 and one TTL)."""
    with store.engine.begin() as conn:
        conn.execute(update(leader_lease).values(expires_at_ms=0))


def _wait_for_lock_waiters(store: Store, n: int, timeout: float = 30.0) -> None:
    """Until ``n`` backends of this database wait for a lock (PostgreSQL says so)."""
    q = text(
        "select count(*) from pg_stat_activity where datname = current_database()"
        " and wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + timeout
    while True:
        with store.engine.connect() as conn:
            if conn.execute(q).scalar_one() >= n:
                return
        assert time.monotonic() < deadline, f"fewer than {n} statements wait for a lock"
        time.sleep(0.02)


def _vm(vm_id: str, tenant_id: str) -> VmRecord:
    now = datetime.now(UTC)
    return VmRecord(vm_id=vm_id, tenant_id=tenant_id, image="default", limits={}, created_at=now,
                    updated_at=now, token="t")  # fmt: skip


async def test_one_leader_takeover_after_expiry_and_fencing(url: str) -> None:
    a_store, b_store = Store(url), Store(url, run_migrations=False)
    tenant, _ = a_store.create_tenant("acme", 5)  # before any fence: an operator's write
    a = LeaseLeader(a_store, "http://a", ttl_s=5)
    b = LeaseLeader(b_store, "http://b", ttl_s=5)
    assert await a.acquire() and await a.is_leader()
    assert not await b.acquire() and not await b.is_leader()
    assert await b.leader_url() == "http://a"
    ta = Transitioner(a_store)
    await ta.create(tenant.id, [_vm("vm-1", tenant.id)], Action.SCHEDULE)  # the leader writes
    with pytest.raises(NotLeader):  # a follower may not
        await Transitioner(b_store).create(tenant.id, [_vm("vm-2", tenant.id)], Action.SCHEDULE)

    assert await a.acquire()  # renewal keeps the token
    token_a = a.token
    _expire(a_store)
    assert await b.acquire() and b.token == (token_a or 0) + 1
    assert await b.leader_url() == "http://b"
    # The deposed leader's late write fails (it has not noticed yet: it still "leads").
    assert await a.is_leader()
    with pytest.raises(NotLeader, match="stale"):
        await ta.transition("vm-1", Action.PLACE)
    assert a_store.get_vm("vm-1").state == "pending"  # type: ignore[union-attr]
    assert not await a.acquire() and a.token is None  # its next renewal finds out
    await Transitioner(b_store).transition("vm-1", Action.PLACE)

    token_b = b.token
    await b.release()  # a clean shutdown hands over at once
    assert await a.acquire() and a.token == (token_b or 0) + 1


async def test_takeover_waits_for_the_old_leaders_write_in_flight(url: str) -> None:
    """A write under token N holds the lease row FOR SHARE: the takeover's UPDATE waits for
    it, so no write of the old token can commit after the new token exists."""
    store = Store(url)
    tenant, _ = store.create_tenant("acme", 5)
    a = LeaseLeader(store, "http://a", ttl_s=5)
    assert await a.acquire()
    other = Store(url, run_migrations=False)
    inside, release = threading.Event(), threading.Event()
    took: list[int | None] = []

    def slow_write() -> None:
        with store.write() as tx:
            tx.add_event("vm-x", tenant.id, "status", to_state="pending")
            inside.set()
            release.wait(30)

    def takeover() -> None:
        took.append(other.lease_acquire("b", "http://b", 5000))

    _expire(store)  # the lease ran out, but nobody took it yet: the old token still writes
    w = threading.Thread(target=slow_write)
    w.start()
    assert inside.wait(30)
    t = threading.Thread(target=takeover)
    t.start()
    _wait_for_lock_waiters(store, 1)  # the takeover waits behind the writer's share lock
    assert took == []
    release.set()
    w.join(30)
    t.join(30)
    assert took == [2]  # taken once the old token's write had committed
    assert [e.to_state for e in store.list_events("vm-x")] == ["pending"]


async def test_transitions_of_one_vm_from_two_processes_serialise(url: str) -> None:
    """Two writers (no fence) race PAUSE-like moves of one VM: exactly one wins, one event."""
    s1, s2 = Store(url), Store(url, run_migrations=False)
    tenant, _ = s1.create_tenant("acme", 5)
    t1, t2 = Transitioner(s1), Transitioner(s2)
    await t1.create(tenant.id, [_vm("vm-1", tenant.id)], Action.SCHEDULE)

    async def place(t: Transitioner) -> str:
        try:
            await t.transition("vm-1", Action.PLACE)
            return "ok"
        except Exception as exc:
            return type(exc).__name__

    results = await asyncio.gather(
        asyncio.to_thread(lambda: asyncio.run(place(t1))), asyncio.to_thread(lambda: asyncio.run(place(t2)))
    )
    assert sorted(results) == ["IllegalTransition", "ok"]
    assert [e.to_state for e in s1.list_events("vm-1")] == ["pending", "spawning"]


def test_a_server_whose_owner_died_is_reaped_by_the_next_one() -> None:
    """A test run killed by a timeout leaves its PostgreSQL running; the next LocalPostgres
    stops it (and only servers whose recorded owner is gone)."""
    import os
    import signal
    import subprocess
    import sys

    from pal_tools.localcluster import postgres as pgmod

    code = "from pal_tools.localcluster.postgres import LocalPostgres; pg = LocalPostgres().start(); print(pg.base, flush=True); import time; time.sleep(600)"  # noqa: E501
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    base = Path(child.stdout.readline().strip())
    assert (base / pgmod.OWNER_FILE).read_text().strip() == str(child.pid)
    assert base not in pgmod.reap_orphans()  # its owner lives: untouched
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert base in pgmod.reap_orphans()
    assert not base.exists()
