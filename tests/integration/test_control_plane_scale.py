"""The control plane's loops do not grow with the records they leave alone (issue 35,
docs/scale.md): the `pal bench control-plane` harness at 10^3 sandbox records and 20
simulated nodes (a real `pal server` on PostgreSQL, the nodes on the real node RPC; no VM
is booted), each of the leader's loops measured over a few sweeps; then ten times as many
idle records (snapshot-paused and terminated VMs, a thousand tenants' worth of events) are
added under it, and every loop must read no more rows per tick than before. The rows are
those the store returned each tick (pal/store/counting.py); that each of those statements
reads an index and not the table is tests/unit/test_query_plans.py's part.
"""

from __future__ import annotations

from pathlib import Path

from pal.store import Store
from pal_tools.bench.control_plane import Options, Run, loop_window, start_cluster
from pal_tools.bench.cp_pg import PgFigures
from pal_tools.bench.fleet import FleetPlan, analyze, fill
from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import LocalCluster

RECORDS, NODES, IDLE_ADDED = 1_000, 20, 10_000
SWEEPS = 3  # sweeps measured before and after


def _log(msg: str) -> None:
    print(msg, flush=True)


def test_no_loop_reads_more_rows_per_tick_when_idle_records_are_added(
    postgres: LocalPostgres, tmp_path: Path
) -> None:
    url = postgres.new_database("scale")
    Store(url).close()
    fleet = fill(url, FleetPlan(RECORDS, NODES))
    pgf = PgFigures(url)
    opts = Options(replicas=1, heartbeat_s=1.0, processes=1)
    env = {"PAL_LOG_LEVEL": "WARNING", "PAL_NODE_HEARTBEAT_INTERVAL": "1", "PAL_IDLE_SWEEP_INTERVAL": "1"}
    run = Run(tmp_path, LocalCluster(base=tmp_path, database_url=url, shared_images=tmp_path, extra_env=env))
    try:
        start_cluster(run, pgf, fleet, opts, _log)
        loop_window(run, 2)  # the first sweeps after the takeover
        before = loop_window(run, SWEEPS)
        # Ten times the fleet in idle records: paused VMs (on nodes gone since) and
        # terminated ones, with their events and tags, in tenants of their own.
        extra = FleetPlan(IDLE_ADDED, 5, running=0.0, paused=0.5, live_share=0.0, label="idle",
                          node_prefix="gone", seed=7)  # fmt: skip
        fill(url, extra)
        analyze(url)
        after = loop_window(run, SWEEPS)
    finally:
        run.stop()
        pgf.close()
    _log(f"before: {before}\nafter: {after}")
    assert {"idle_sweep", "reconcile", "lifetimes", "retention", "snapshot_audit", "heartbeat"} <= set(after)
    grew = {
        name: (before.get(name, {}).get("rowsPerTick", 0.0), got["rowsPerTick"])
        for name, got in after.items()
        # a tenth of the records added, read by any tick, is a loop over the idle fleet
        if got["rowsPerTick"] > before.get(name, {}).get("rowsPerTick", 0.0) + IDLE_ADDED / 10
    }
    assert grew == {}, f"rows per tick (before, after) of the loops that grew with the idle records: {grew}"
