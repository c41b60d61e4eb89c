"""`GET /metrics`: the operator's Prometheus endpoint (prometheus_client text format).

Who may read it: it is an operator endpoint, never a tenant's. It names every tenant id
and the node's totals, so a tenant API key does not open it. A request must carry
``Authorization: Bearer <token>`` with the operator token (pal/operator.py) or
``PAL_METRICS_TOKEN`` (a scraper's, which opens nothing else). No client is trusted for
its address: loopback included (pal/api/operator.py).

Exposed (besides the scheduler's latency histograms, see ``pal.scheduler.telemetry``):

- ``pal_vms{state}``: VM rows by lifecycle state (terminated ones included).
- ``pal_tenant_slots_used{tenant}``, ``pal_tenant_slots_limit{tenant}``: quota use per tenant id.
- ``pal_node_up{node}``: one per node the store knows (lost ones and those that did not
  answer this scrape: 0), ``pal_node_vms_live{node}``, ``pal_node_info{node,accel}``.
- ``pal_snapshot_bytes{node,tier="local"|"s3"}``: snapshot bytes per tier as each node sees
  them (cached up to 30 s). Nodes sharing a bucket report the same S3 figure: take the max.
- ``pal_s3_queue_depth{node}``, ``pal_seal_queue_depth{node}``: each node's pending S3 jobs
  (incl. retries) and pending seals.
- ``pal_pool_ready{node}``, ``pal_pool_target{node}``, ``pal_pool_rss_bytes{node}``,
  ``pal_pool_claims{node}``, ``pal_pool_misses{node}``: the warm pool (docs/lifecycle.md,
  "The warm pool"): VMs ready to claim, how many it keeps, what their QEMUs hold resident,
  and the schedules that claimed one or found none of their size.
- ``pal_prestart_ready{node}``, ``pal_prestart_target{node}``, ``pal_prestart_rss_bytes{node}``,
  ``pal_prestart_takes{node}``, ``pal_prestart_misses{node}``: the QEMUs waiting for a
  restore (docs/lifecycle.md, "Pre-started QEMUs"), the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pal.config import Settings
from pal.scheduler.views import OperatorStats

from .deps import scheduler_of
from .operator import require_metrics_reader

# The warm pool's and the pre-started QEMUs' gauges (``pal_<field>``), each a NodeStats field.
_HELD_QEMUS = {
    "pool_ready": "Warm pool VMs ready to claim",
    "pool_target": "Warm pool VMs the node keeps (PAL_POOL within PAL_POOL_MEMORY_MIB)",
    "pool_rss_bytes": "Resident host memory of the warm pool's QEMUs",
    "pool_claims": "Schedules that claimed a pooled VM since the node started",
    "pool_misses": "Schedules of a pooled size that found none ready",
    "prestart_ready": "QEMUs waiting in -incoming defer for a restore to take",
    "prestart_target": "QEMUs the node keeps waiting (PAL_PRESTART)",
    "prestart_rss_bytes": "Resident host memory of the waiting QEMUs",
    "prestart_takes": "Restores that took a waiting QEMU since the node started",
    "prestart_misses": "Restores of a pre-started size that found none fitting",
}


class _StatsCollector(Collector):
    """The figures read at this scrape, as gauges."""

    def __init__(self, stats: OperatorStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        vms = GaugeMetricFamily("pal_vms", "VMs by lifecycle state", labels=["state"])
        for state, n in sorted(st.vms_by_state.items()):
            vms.add_metric([state], n)
        yield vms
        used = GaugeMetricFamily("pal_tenant_slots_used", "Quota slots held per tenant", labels=["tenant"])
        limit = GaugeMetricFamily("pal_tenant_slots_limit", "Quota (max VMs) per tenant", labels=["tenant"])
        for tenant_id, n_used, n_max in st.tenants:
            used.add_metric([tenant_id], n_used)
            limit.add_metric([tenant_id], n_max)
        yield used
        yield limit
        up = GaugeMetricFamily("pal_node_up", "1 when the node's runtime manager answers", labels=["node"])
        info = GaugeMetricFamily("pal_node_info", "The node and its accelerator", labels=["node", "accel"])
        live = GaugeMetricFamily("pal_node_vms_live", "QEMU processes running on the node", labels=["node"])
        snap = GaugeMetricFamily(
            "pal_snapshot_bytes", "Snapshot bytes per tier, as each node sees it", labels=["node", "tier"]
        )
        s3q = GaugeMetricFamily(
            "pal_s3_queue_depth",
            "S3 jobs waiting on the node (uploads, deletes, retention), retries included",
            labels=["node"],
        )
        seals = GaugeMetricFamily(
            "pal_seal_queue_depth", "Snapshots waiting for their background checksum", labels=["node"]
        )
        held = {f: GaugeMetricFamily(f"pal_{f}", what, labels=["node"]) for f, what in _HELD_QEMUS.items()}
        for report in st.nodes:
            node = report.stats
            up.add_metric([report.node_id], 1 if node else 0)
            if node is None:
                continue
            info.add_metric([report.node_id, node.accel], 1)
            live.add_metric([report.node_id], node.vms_live)
            snap.add_metric([report.node_id, "local"], node.snapshot_bytes_local)
            if node.snapshot_bytes_s3 is not None:
                snap.add_metric([report.node_id, "s3"], node.snapshot_bytes_s3)
            s3q.add_metric([report.node_id], node.s3_queue_depth)
            seals.add_metric([report.node_id], node.seal_queue_depth)
            for f, fam in held.items():
                fam.add_metric([report.node_id], getattr(node, f))
        yield from (up, info, live, snap, s3q, seals, *held.values())


def metrics_router(settings: Settings) -> APIRouter:
    r = APIRouter()

    @r.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        require_metrics_reader(request, settings)
        scheduler = scheduler_of(request.app.state)
        stats = await scheduler.reads.operator_stats()
        scrape = CollectorRegistry(auto_describe=False)
        scrape.register(_StatsCollector(stats))
        body = generate_latest(scheduler.telemetry.registry) + generate_latest(scrape)
        return Response(body, media_type=CONTENT_TYPE_LATEST, headers={"Cache-Control": "no-store"})

    return r
