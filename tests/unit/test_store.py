"""The store: migrations at open, tenants and API keys, VM rows and events."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pal.config import Settings
from pal.errors import Conflict, InvalidRequest
from pal.store import LIFECYCLE_COLUMNS, Store, VmRecord, hash_api_key
from pal_tools.localcluster.postgres import LocalPostgres


def _vm(vm_id: str, tenant_id: str, **kw: object) -> VmRecord:
    now = datetime.now(UTC)
    base: dict[str, object] = dict(
        vm_id=vm_id,
        tenant_id=tenant_id,
        state="running",
        image="default",
        limits={"vcpus": 1, "memory_mib": 256, "disk_mib": 2048},
        created_at=now,
        updated_at=now,
        token="tok",
        secrets={"API_KEY": "s3cret"},
    )
    base.update(kw)
    return VmRecord(**base)  # type: ignore[arg-type]


def _head() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from pal.store.migrate import MIGRATIONS_DIR

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


def test_open_runs_migrations_and_enables_wal(tmp_path: Path) -> None:
    store = Store.open(Settings(data_dir=tmp_path / "dd"))
    store.close()
    db = sqlite3.connect(tmp_path / "dd" / "pal.db")
    try:
        assert db.execute("select version_num from alembic_version").fetchall() == [(_head(),)]
        tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
        assert {"tenants", "vms", "events"} <= tables
        assert db.execute("pragma journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()
    # Re-opening an up-to-date database is a no-op, not an error.
    Store.open(Settings(data_dir=tmp_path / "dd")).close()


def test_tenant_api_key_is_shown_once_and_stored_hashed(tmp_path: Path) -> None:
    store = Store.open(Settings(data_dir=tmp_path))
    tenant, key = store.create_tenant("acme", 5)
    assert store.tenant_by_api_key(key) == tenant
    assert store.tenant_by_api_key(key + "x") is None
    db = sqlite3.connect(tmp_path / "pal.db")
    stored = db.execute("select api_key_sha256 from tenants").fetchone()[0]
    db.close()
    assert stored == hash_api_key(key) and key not in stored
    assert [t.name for t in store.list_tenants()] == ["acme"]
    assert tenant.created_at.tzinfo is not None


def test_tenant_names_are_unique_and_validated(tmp_path: Path, db_url: str) -> None:
    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    store.create_tenant("acme", 5)
    with pytest.raises(Conflict):
        store.create_tenant("acme", 3)
    with pytest.raises(InvalidRequest):
        store.create_tenant(" ", 3)
    with pytest.raises(InvalidRequest):
        store.create_tenant("b", -1)


def test_vm_rows_round_trip_as_dataclasses(tmp_path: Path, db_url: str) -> None:
    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    tenant, _ = store.create_tenant("acme", 5)
    with store.write() as tx:
        tx.insert_vm(_vm("vm-a", tenant.id, parent_vm_id="vm-p", mem_snapshot_id="snap-1"))
    got = store.get_vm("vm-a")
    assert isinstance(got, VmRecord)
    assert got.secrets == {"API_KEY": "s3cret"} and got.limits["memory_mib"] == 256
    assert got.parent_vm_id == "vm-p" and got.mem_snapshot_id == "snap-1"
    assert got.created_at.tzinfo is not None
    assert [v.vm_id for v in store.list_vms(mem_snapshot_id="snap-1")] == ["vm-a"]
    assert store.list_vms(tenant_id="other") == []


def test_guarded_update_only_applies_in_the_expected_state(tmp_path: Path, db_url: str) -> None:
    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    tenant, _ = store.create_tenant("acme", 5)
    with store.write() as tx:
        tx.insert_vm(_vm("vm-a", tenant.id))
    with store.write() as tx:
        assert not tx.write_lifecycle("vm-a", expect_state="paused", state="spawning")
        assert tx.write_lifecycle("vm-a", expect_state="running", state="draining")
    assert store.get_vm("vm-a").state == "draining"  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        store.update_vm("vm-a", no_such_column=1)


@pytest.mark.parametrize("column", sorted(LIFECYCLE_COLUMNS))
def test_plain_updates_refuse_lifecycle_columns(tmp_path: Path, column: str, db_url: str) -> None:
    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    tenant, _ = store.create_tenant("acme", 5)
    with store.write() as tx:
        tx.insert_vm(_vm("vm-a", tenant.id, snapshot_id="snap-1", paused_by="idle", reason="r"))
    before = store.get_vm("vm-a")
    with pytest.raises(ValueError, match="transition function"):
        store.update_vm("vm-a", **{column: None}, last_activity_unix_ms=5)
    with pytest.raises(ValueError, match="transition function"), store.write() as tx:
        tx.update_vm("vm-a", **{column: None})
    assert store.get_vm("vm-a") == before  # nothing written, not even the allowed column
    assert store.update_vm("vm-a", last_activity_unix_ms=7)


def test_failed_write_transaction_leaves_nothing(tmp_path: Path, db_url: str) -> None:
    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    tenant, _ = store.create_tenant("acme", 5)
    with pytest.raises(RuntimeError), store.write() as tx:
        tx.insert_vm(_vm("vm-a", tenant.id))
        tx.add_event("vm-a", tenant.id, "status", to_state="running")
        raise RuntimeError("boom")
    assert store.get_vm("vm-a") is None
    assert store.list_events("vm-a") == []


def test_events_are_listed_in_order(tmp_path: Path, db_url: str) -> None:
    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    tenant, _ = store.create_tenant("acme", 5)
    store.add_event("vm-a", tenant.id, "status", to_state="pending")
    store.add_event("vm-a", tenant.id, "status", from_state="pending", to_state="spawning")
    store.add_event("vm-a", tenant.id, "auto_resume", reason="exec")
    assert [(e.kind, e.to_state) for e in store.list_events("vm-a")] == [
        ("status", "pending"),
        ("status", "spawning"),
        ("auto_resume", None),
    ]


def test_a_ring_event_keeps_the_newest_of_its_kind_per_vm(tmp_path: Path, db_url: str) -> None:
    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    tenant, _ = store.create_tenant("acme", 5)
    store.add_event("vm-a", tenant.id, "status", to_state="running")
    for i in range(12):
        store.add_ring_event("vm-a", tenant.id, "mcp_tool", 5, reason=str(i))
        store.add_ring_event("vm-b", tenant.id, "mcp_tool", 5, reason=str(i))
    for vm in ("vm-a", "vm-b"):
        ring = [e.reason for e in store.list_events(vm) if e.kind == "mcp_tool"]
        assert ring == ["7", "8", "9", "10", "11"]
    assert next(e.kind for e in store.list_events("vm-a")) == "status", "other kinds stay"


def test_records_are_their_tables_columns() -> None:
    """A VM field is declared in records.py and tables.py (+ a migration); rows are read
    into records by these names."""
    from dataclasses import fields

    from pal.store.records import EventRecord, Tenant
    from pal.store.tables import events, tenants, vms

    def names(cls: type) -> set[str]:
        return {f.name for f in fields(cls)}

    assert names(VmRecord) == {c.name for c in vms.columns}
    assert names(EventRecord) == {c.name for c in events.columns}
    never_read_back = {"api_key_sha256", "prev_api_key_sha256"}
    assert names(Tenant) == {c.name for c in tenants.columns} - never_read_back
    from pal.store.records import VolumeRecord
    from pal.store.tables import volumes

    assert names(VolumeRecord) == {c.name for c in volumes.columns}


def test_migrations_build_the_schema_the_code_declares(tmp_path: Path, db_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from pal.store.tables import metadata

    store = Store.open(Settings(data_dir=tmp_path, database_url=db_url))
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


# Each process is one replica starting: imported first, then it opens the store (which
# migrates) when told to go, so all of them migrate at the same moment.
_REPLICA = """
import sys
from pal.store import Store
url = sys.argv[1]
print("ready", flush=True)
sys.stdin.readline()
Store(url).close()
print("migrated")
"""


def test_replicas_starting_together_on_an_empty_database_all_start(postgres: LocalPostgres) -> None:
    """Several `pal server`s started at once on a fresh PostgreSQL database: one migrates
    under the advisory lock, the others wait for it and find the schema at head."""
    import os
    import subprocess
    import sys

    from pal.store import migrate

    url = postgres.new_database("race")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _REPLICA, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for _ in range(4)
    ]
    try:
        for p in procs:  # every replica is imported and waiting
            assert p.stdout is not None
            assert p.stdout.readline() == b"ready\n", p.communicate(timeout=60)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failures = [err.decode()[-2000:] for p, (_, err) in zip(procs, results, strict=True) if p.returncode]
    assert failures == []
    assert all(out.strip() == b"migrated" for out, _ in results)
    store = Store(url, run_migrations=False)
    try:
        assert migrate.current(store.engine) == migrate.head()
    finally:
        store.close()
