"""The hot reads' query plans as PostgreSQL chooses them at each size of `pal bench
control-plane` (the statements the store builds, with representative values), so the report
shows which index each reads (tests/unit/test_query_plans.py fails on a table scan)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.dialects import postgresql

from pal.store.due import idle_due_queries, paused_page_query, slot_rows_query, unlist_query
from pal.store.paging import event_page_query, lifetime_over_query, vm_page_query
from pal.store.tables import vms


def hot_reads(tenant_id: str, team: str, node_id: str = "sim0000", vm_id: str = "vm-0") -> dict[str, Any]:
    """name -> (SQL with %(name)s parameters, the parameters)."""
    now = datetime.now(UTC)
    now_ms = int(now.timestamp() * 1000)
    queries: dict[str, Select[Any]] = {
        "get": select(vms).where(vms.c.vm_id == vm_id),
        "list page": vm_page_query(tenant_id, after=None, limit=101),
        "list page by metadata": vm_page_query(tenant_id, after=None, limit=101, metadata={"team": team}),
        "events page": event_page_query(vm_id, after=None, limit=101),
        "idle due (snapshot tier)": idle_due_queries(now_ms, 1000)[0],
        "idle due (live tier)": idle_due_queries(now_ms, 1000)[1],
        "lifetimes due": lifetime_over_query(now, 1000),
        "a node's VMs (live view, node loss)": slot_rows_query([node_id]),
        "retention: to unlist": unlist_query(now - timedelta(hours=1), 1000),
        "snapshot audit page": paused_page_query("", 50),
    }
    out = {}
    for name, q in queries.items():
        compiled = q.compile(
            dialect=postgresql.psycopg.dialect(),  # type: ignore[attr-defined]
            compile_kwargs={"render_postcompile": True},
        )
        out[name] = (str(compiled), compiled.params)
    return out
