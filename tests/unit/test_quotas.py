"""Quota accounting: all-or-nothing reservations, exactly-once release, no overbooking."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest

from pal.errors import QuotaExceeded
from pal.scheduler import quotas
from pal.store import Store, VmRecord


def reserve(store: Store, tenant_id: str, **kw: object) -> None:
    with store.write() as tx:
        quotas.reserve_in(tx, tenant_id, **kw)  # type: ignore[arg-type]


def release(store: Store, vm_id: str) -> bool:
    with store.write() as tx:
        return quotas.release_in(tx, vm_id)


def _vm(vm_id: str, tenant_id: str, state: str = "pending") -> VmRecord:
    now = datetime.now(UTC)
    return VmRecord(
        vm_id=vm_id, tenant_id=tenant_id, state=state, image="default", limits={},
        created_at=now, updated_at=now, token="t",
    )  # fmt: skip


@pytest.fixture
def store(db_url: str) -> Store:
    return Store(db_url)


def test_reserve_is_all_or_nothing(store: Store) -> None:
    tenant, _ = store.create_tenant("acme", 3)
    reserve(store, tenant.id, new_vms=[_vm("a", tenant.id)])
    with pytest.raises(QuotaExceeded) as ei:
        reserve(store, tenant.id, new_vms=[_vm(f"f{i}", tenant.id) for i in range(3)])
    assert "max_vms=3" in ei.value.message and ei.value.status == 402
    assert [v.vm_id for v in store.list_vms()] == ["a"]  # none of the three was inserted
    reserve(store, tenant.id, new_vms=[_vm("b", tenant.id), _vm("c", tenant.id)])
    assert store.count_slots(tenant.id) == 3


def test_the_quota_error_names_the_vms_that_hold_the_slots(store: Store) -> None:
    tenant, _ = store.create_tenant("acme", 10)
    reserve(store, tenant.id, new_vms=[_vm(f"vm-{i:02}", tenant.id, "running") for i in range(10)])
    with pytest.raises(QuotaExceeded) as ei:
        reserve(store, tenant.id, new_vms=[_vm("new", tenant.id)])
    msg = ei.value.message
    assert "10 in use (vm-00 (running), vm-01 (running)" in msg and "vm-07 (running) and 2 more)" in msg
    assert "vm-08" not in msg and "delete one, or pause it" in msg


def test_release_happens_exactly_once(store: Store) -> None:
    tenant, _ = store.create_tenant("acme", 1)
    reserve(store, tenant.id, new_vms=[_vm("a", tenant.id)])
    assert release(store, "a") is True
    assert release(store, "a") is False  # the reconciler's late release is a no-op
    assert store.count_slots(tenant.id) == 0


def test_resume_reserves_an_existing_row_and_respects_the_limit(store: Store) -> None:
    tenant, _ = store.create_tenant("acme", 1)
    reserve(store, tenant.id, new_vms=[_vm("a", tenant.id)])
    release(store, "a")
    reserve(store, tenant.id, new_vms=[_vm("b", tenant.id)])
    with pytest.raises(QuotaExceeded):
        reserve(store, tenant.id, existing=["a"])
    assert store.get_vm("a").holds_slot is False  # type: ignore[union-attr]
    release(store, "b")
    reserve(store, tenant.id, existing=["a"])
    reserve(store, tenant.id, existing=["a"])  # already holding: no second slot
    assert store.count_slots(tenant.id) == 1


def test_concurrent_reserves_never_exceed_max(db_url: str) -> None:
    """Eight writers, each with its own connection pool, race for five slots (on
    PostgreSQL, as replicas do: each its own connections, row locks decide)."""
    setup = Store(db_url)
    tenant, _ = setup.create_tenant("acme", 5)
    stores = [Store(db_url, run_migrations=False) for _ in range(8)]
    start = threading.Barrier(len(stores))
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(i: int, store: Store) -> None:
        start.wait()
        for j in range(3):
            try:
                reserve(store, tenant.id, new_vms=[_vm(f"vm-{i}-{j}", tenant.id)])
                res = "ok"
            except QuotaExceeded:
                res = "402"
            with lock:
                outcomes.append(res)

    threads = [threading.Thread(target=worker, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("ok") == 5 and outcomes.count("402") == 19
    assert setup.count_slots(tenant.id) == 5
    assert len(setup.list_vms()) == 5
