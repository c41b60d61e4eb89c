"""Paged lists, metadata and lifetimes below the API: the store's keyset pages, metadata
filter and overdue lifetimes on both databases; the cursors; the metadata bounds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pal.api import pagination as pages
from pal.errors import InvalidRequest
from pal.spec import MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS, AgentSpec, LifetimeUpdate
from pal.store import Store, VmRecord
from pal.store.paging import event_page, lifetime_over, vm_page

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _vm(vm_id: str, tenant_id: str, at: datetime, **kw: object) -> VmRecord:
    base: dict[str, object] = dict(
        vm_id=vm_id,
        tenant_id=tenant_id,
        state="running",
        image="default",
        limits={},
        created_at=at,
        updated_at=at,
        token="tok",
    )
    base.update(kw)
    return VmRecord(**base)  # type: ignore[arg-type]


@pytest.fixture
def store(db_url: str) -> Store:
    return Store(db_url)


def _walk(store: Store, tenant: str, size: int, metadata: dict[str, str] | None = None) -> list[str]:
    seen: list[str] = []
    after = None
    while True:
        rows = vm_page(store, tenant, after=after, limit=size + 1, metadata=metadata)
        page, cursor = pages.next_cursor("vms", rows, size, lambda v: (v.created_at.isoformat(), v.vm_id))
        seen += [v.vm_id for v in page]
        if cursor is None:
            return seen
        after = pages.dated_after("vms", cursor)


def test_vm_pages_cover_the_list_once_in_order_with_metadata_filters(store: Store) -> None:
    tenant, _ = store.create_tenant("acme", 50)
    other, _ = store.create_tenant("other", 50)
    with store.write() as tx:
        for i in range(7):
            # two VMs share each creation time: the id breaks the tie
            meta = {"run": "r1" if i % 2 else "r2", "team": "a" if i < 4 else "b"}
            tx.insert_vm(_vm(f"vm-{i}", tenant.id, T0 + timedelta(seconds=i // 2), metadata=meta))
        tx.insert_vm(_vm("vm-x", other.id, T0, metadata={"run": "r1"}))
    everything = [f"vm-{i}" for i in range(7)]
    for size in (1, 2, 3, 7, 100):
        assert _walk(store, tenant.id, size) == everything
    assert _walk(store, tenant.id, 2, {"run": "r1"}) == ["vm-1", "vm-3", "vm-5"]
    assert _walk(store, tenant.id, 1, {"run": "r1", "team": "b"}) == ["vm-5"]
    assert _walk(store, tenant.id, 1, {"run": "nope"}) == []


def test_event_pages_and_overdue_lifetimes(store: Store) -> None:
    tenant, _ = store.create_tenant("acme", 50)
    now = datetime.now(UTC)
    with store.write() as tx:
        tx.insert_vm(_vm("vm-due", tenant.id, T0, lifetime_ends_at=now - timedelta(seconds=1)))
        tx.insert_vm(_vm("vm-later", tenant.id, T0, lifetime_ends_at=now + timedelta(hours=1)))
        tx.insert_vm(_vm("vm-none", tenant.id, T0))
        tx.insert_vm(
            _vm("vm-gone", tenant.id, T0, state="terminated", lifetime_ends_at=now - timedelta(seconds=5))
        )
        for i in range(5):
            tx.add_event("vm-due", tenant.id, "status", reason=str(i))
    assert [v.vm_id for v in lifetime_over(store, now)] == ["vm-due"]
    first = event_page(store, "vm-due", after=None, limit=3)
    rest = event_page(store, "vm-due", after=first[-1].id, limit=3)
    assert [e.reason for e in first + rest] == ["0", "1", "2", "3", "4"]


def test_cursors_are_opaque_and_refused_when_foreign_or_broken() -> None:
    c = pages.encode("events", 42)
    assert pages.event_after(c) == 42 and "42" not in c
    for bad in ("garbage", "", pages.encode("vms", 42), pages.encode("events", "x"), "!!!!"):
        with pytest.raises(InvalidRequest):
            pages.event_after(bad)
    with pytest.raises(InvalidRequest):
        pages.dated_after("vms", pages.encode("vms", ["not a time", "vm-1"]))
    items = [{"n": n} for n in "dbeca"]
    page, cursor = pages.in_memory("images", items, lambda i: i["n"], 2, None)
    assert [i["n"] for i in page] == ["a", "b"]
    page, cursor = pages.in_memory("images", items, lambda i: i["n"], 2, cursor)
    assert [i["n"] for i in page] == ["c", "d"]
    page, cursor = pages.in_memory("images", items, lambda i: i["n"], 2, cursor)
    assert [i["n"] for i in page] == ["e"] and cursor is None


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({f"k{i}": "v" for i in range(MAX_METADATA_KEYS + 1)}, "keys; at most"),
        ({"bad key": "v"}, "metadata key 'bad key'"),
        ({"-lead": "v"}, "metadata key '-lead'"),
        ({"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}, "a string of at most"),
        ({"k": 1}, "a string of at most"),
        ({f"k{i}": "é" * 200 for i in range(20)}, "bytes as JSON"),
    ],
)
def test_metadata_out_of_bounds_is_refused_with_the_reason(metadata: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        AgentSpec.model_validate({"metadata": metadata})


def test_lifetime_update_takes_exactly_one_of_set_and_extend() -> None:
    assert LifetimeUpdate.model_validate({"lifetimeSecs": 0}).lifetime_secs == 0
    for bad in ({}, {"lifetimeSecs": 5, "extendSecs": 5}, {"extendSecs": 0}, {"onLifetimeEnd": "pause"}):
        with pytest.raises(ValueError):
            LifetimeUpdate.model_validate(bad)
