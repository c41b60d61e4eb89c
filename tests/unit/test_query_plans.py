"""Every hot query of the control plane reads an index, never a whole large table (issue 35,
docs/scale.md): on a real PostgreSQL filled with a fleet of 20,000 sandbox records (the
benchmark's fill: mostly paused and terminated, their events, tags and snapshots), an
in-process leader with simulated nodes runs its takeover, a sweep of every loop, node
heartbeats, and the API's operations and reads; every statement they sent is then
explained by PostgreSQL, and the test fails on a sequential scan of a large table.

The statements are the ones the code sent (captured from the engine), not a list kept
by hand, so a new query on a hot path is checked the day it is written.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from pal.config import Settings
from pal.scheduler.scheduler import Scheduler
from pal.spec import AgentSpec, PauseRequest
from pal.store import Store
from pal_tools.bench.fleet import Fleet, FleetPlan, fill
from pal_tools.bench.simnode import SimNode, SimNodeConfig, SimTimes
from pal_tools.localcluster.postgres import LocalPostgres
from tests.fakes import InProcessNode

LARGE = ("vms", "events", "vm_tags")  # the tables that grow with the fleet
SEQ_SCAN = re.compile(r"Seq Scan on (" + "|".join(LARGE) + r")\b")
RECORDS, NODES = 20_000, 10


@pytest.fixture(scope="module")
def filled(postgres: LocalPostgres) -> Iterator[tuple[str, Fleet]]:
    url = postgres.new_database("plans")
    Store(url).close()
    yield url, fill(url, FleetPlan(RECORDS, NODES))


class Recorder:
    """The statements an engine sends, with their parameters (one of each text)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def __call__(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        self.seen.setdefault(statement, parameters)


async def _exercise(store: Store, settings: Settings, fleet: Fleet) -> Scheduler:
    sched = Scheduler(settings, store)
    nodes = {}
    for node_id in fleet.node_ids:
        seed = fleet.seeds[node_id]
        sim = SimNode(SimNodeConfig(node_id, f"http://127.0.0.1:1/n/{node_id}", times=SimTimes(0, 0, 0, 0, 0),
                                    memory_mib=seed["memoryMib"]))  # fmt: skip
        for vm_id, tenant_id, inc, last_ms, live in seed["running"]:
            sim.seed_running(vm_id, tenant_id, inc, last_ms, live)
        for vm_id, snap in seed["snapshots"]:
            sim.seed_snapshot(vm_id, snap)
        sched.nodes.use_client(node_id, InProcessNode(sim.handlers()))
        nodes[node_id] = sim
    for sim in nodes.values():  # the nodes register, as pushed heartbeats do
        await sched.reconciler.node_heartbeat(await sim.heartbeat())
    await sched.background.lead_once()  # takeover: reconcile every node
    await sched.background.sweep_once()  # every loop once
    for sim in nodes.values():
        await sched.reconciler.node_heartbeat(await sim.heartbeat())
    await sched.reconciler.lose_silent_nodes()
    tenant = fleet.tenant_id
    vm, _ = await sched.scheduling.schedule(tenant, AgentSpec.model_validate({"metadata": {"team": "t7"}}))
    await sched.reads.get(tenant, vm.vm_id)
    await sched.listing.vms(tenant, after=None, limit=101, metadata={})
    page = await sched.listing.vms(tenant, after=None, limit=101, metadata={"team": "t7", "env": "prod"})
    await sched.listing.vms(
        tenant, after=(page[-1].created_at, page[-1].vm_id), limit=101, metadata={"team": "t7"}
    )
    await sched.listing.events(tenant, vm.vm_id, after=None, limit=101)
    await sched.pauses.pause(tenant, vm.vm_id)
    await sched.pauses.resume(tenant, vm.vm_id)
    await sched.pauses.pause(tenant, vm.vm_id, PauseRequest.model_validate({"mode": "live"}))
    await sched.pauses.resume(tenant, vm.vm_id)
    forked = await sched.forking.fork(tenant, vm.vm_id, 2)
    for child in forked.forks:
        await sched.deleting.delete(tenant, child.vm_id)
    await sched.deleting.delete(tenant, vm.vm_id)
    await sched.reads.get(tenant, fleet.sample["terminated"][0])
    await sched.pauses.resume(tenant, fleet.sample["paused"][0])
    await sched.background.sweep_once()
    return sched


async def test_no_hot_query_scans_a_large_table(filled: tuple[str, Fleet], tmp_path: Path) -> None:
    url, fleet = filled
    store = Store(url, run_migrations=False)
    rec = Recorder()
    event.listen(store.engine, "before_cursor_execute", rec)
    try:
        sched = await _exercise(store, Settings(data_dir=tmp_path, database_url=url), fleet)
        await sched.close()
    finally:
        event.remove(store.engine, "before_cursor_execute", rec)
    plans: dict[str, str] = {}
    with store.engine.raw_connection() as raw:  # type: ignore[attr-defined]
        cur = raw.cursor()
        for statement, params in rec.seen.items():
            if not statement.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "INSERT", "WITH")):
                continue
            cur.execute("EXPLAIN " + statement, params)
            plans[statement] = "\n".join(str(r[0]) for r in cur.fetchall())
        raw.rollback()
    store.close()
    assert len(plans) > 40, "the hot paths ran (statements explained)"
    scans = {s[:300]: p for s, p in plans.items() if SEQ_SCAN.search(p)}
    assert scans == {}, "sequential scans of a large table:\n" + "\n\n".join(
        f"{s}\n{p}" for s, p in scans.items()
    )
