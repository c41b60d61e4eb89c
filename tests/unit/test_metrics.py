"""Metrics without VMs: the node's per-VM sample rings, the per-VM route and the operator's
Prometheus endpoint (parsed with prometheus_client's own parser) on the real Scheduler."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pal.api.app import create_app
from pal.config import Settings
from pal.manager.metrics import MetricsBook, RawReading
from pal.manager.runtime import NodeRuntime
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.s3 import S3Mirror
from pal.snapshots.store import SnapshotStore
from pal.vmm import usage
from pal.vmm.accel import AccelInfo
from pal_tools.localcluster.s3 import free_port
from tests.fakes import FakeManager, FakeVm, SchedEnv, make_env

# -- the node's sample rings ---------------------------------------------------------------


EPOCH = 1_700_000_000.0


class Mono:
    def __init__(self) -> None:
        self.t = 200.0

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        return EPOCH + self.t


def reading(mono: float, cpu_s: float | None, **kw: object) -> RawReading:
    cpu = None if cpu_s is None else int(cpu_s * 1e9)
    return RawReading(at=EPOCH + mono, mono=mono, cpu_ns=cpu, **kw)  # type: ignore[arg-type]


def test_cpu_percent_is_the_rate_between_two_readings_of_one_process() -> None:
    mono = Mono()
    mono.t = 20.0
    book = MetricsBook(interval_s=5, window_s=60, clock=mono, wall=mono.wall)
    book.record("vm-a", reading(0, 1.0), process_key=1)
    book.record("vm-a", reading(5, 3.5), process_key=1)  # 2.5 s of CPU in 5 s
    book.record("vm-a", reading(10, 0.2), process_key=2)  # a new QEMU: its counter restarted
    book.record("vm-a", reading(15, 0.7), process_key=2)
    cpu = [s.cpu_pct for s in book.series("vm-a", live=True).samples]
    assert cpu == [None, 50.0, None, 10.0]


def test_guest_figures_come_from_the_heartbeat_and_nonsense_is_dropped() -> None:
    mono = Mono()
    book = MetricsBook(clock=mono, wall=mono.wall)
    hb = {"mem_used": 50 << 20, "mem_total": 240 << 20, "disk_used": True, "disk_total": -5}
    book.record("vm-a", reading(0, 1.0, heartbeat=hb, rss_bytes=7, pss_bytes=3), process_key=1)
    s = book.series("vm-a", live=True).samples[0]
    assert (s.guest_mem_used_bytes, s.guest_mem_total_bytes) == (50 << 20, 240 << 20)
    assert s.disk_used_bytes is None and s.disk_total_bytes is None  # a bool, a negative
    assert (s.rss_bytes, s.pss_bytes) == (7, 3)
    book.record("vm-a", reading(5, 1.0, heartbeat={"mem_used": "a lot"}), process_key=1)
    assert book.series("vm-a", live=True).samples[1].guest_mem_used_bytes is None


def test_rings_are_bounded_and_a_stopped_vm_keeps_its_series_for_one_window() -> None:
    mono = Mono()
    book = MetricsBook(interval_s=5, window_s=60, max_series=3, clock=mono, wall=mono.wall)
    for i in range(40):
        book.record("vm-a", reading(i * 5, i), process_key=1)
    assert len(book.series("vm-a", live=True).samples) == 12  # 60 s / 5 s
    book.stopped("vm-a")
    kept = book.series("vm-a", live=False)
    assert kept.live is False and len(kept.samples) == 12
    mono.t += 61
    book.expire()
    assert book.series("vm-a", live=False).samples == []
    for name in ("vm-1", "vm-2", "vm-3", "vm-4"):
        book.record(name, reading(0, 0), process_key=1)
    assert sorted(book.known()) == ["vm-2", "vm-3", "vm-4"]  # the least recent went first


def test_process_usage_reads_this_process() -> None:
    mem = usage.process_memory(os.getpid())
    assert mem is not None and 0 < mem.pss_bytes <= mem.rss_bytes
    before = usage.process_cpu_ns(os.getpid())
    sum(i * i for i in range(2_000_000))
    after = usage.process_cpu_ns(os.getpid())
    assert before is not None and after is not None and after > before
    assert usage.process_memory(2**22 + 12345) is None  # no such pid


# -- the routes ---------------------------------------------------------------------------------


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[SchedEnv]:
    e = make_env(tmp_path, max_vms=3)
    e.settings.admin_token = OPERATOR  # what pal.server puts in effect (pal/operator.py)
    yield e
    await e.sched.close()
    e.store.close()


OPERATOR = "the-operator-token"


def _client(app: object, key: str | None = None, client_ip: str = "127.0.0.1") -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app, client=(client_ip, 40000))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://localhost", headers=headers)


async def test_vm_metrics_route_is_tenant_scoped_and_answers_stopped_vms(env: SchedEnv) -> None:
    _, key = env.store.create_tenant("m-user", 3)
    _, other = env.store.create_tenant("m-other", 3)
    app = create_app(env.sched, env.store, env.settings)
    async with _client(app, key) as a, _client(app, other) as b:
        vm = (await a.post("/v1/runtime/schedule", json={})).json()["vmId"]
        m = await a.get(f"/v1/runtime/vms/{vm}/metrics")
        assert m.status_code == 200, m.text
        body = m.json()
        assert body["live"] is True and [s["cpuPct"] for s in body["samples"]] == [0.0, 1.0, 2.0]
        assert (await b.get(f"/v1/runtime/vms/{vm}/metrics")).status_code == 404
        await a.post(f"/v1/runtime/vms/{vm}/pause")
        m = await a.get(f"/v1/runtime/vms/{vm}/metrics")
        assert m.status_code == 200 and m.json()["live"] is False
        snaps = (await a.get(f"/v1/runtime/vms/{vm}/snapshots")).json()["snapshots"]
        assert len(snaps) == 1 and snaps[0]["sizes"] == {"mem": 4096}


def _families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [(s.name, dict(s.labels), s.value) for s in fam.samples]
    return out


async def test_prometheus_endpoint_parses_and_carries_the_operator_figures(env: SchedEnv) -> None:
    _, key = env.store.create_tenant("p-user", 3)
    app = create_app(env.sched, env.store, env.settings)
    async with _client(app, key) as a, _client(app, OPERATOR) as operator:
        vm = (await a.post("/v1/runtime/schedule", json={})).json()["vmId"]
        await a.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/true"})
        await a.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/true"})
        await a.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 2})
        await a.post(f"/v1/runtime/vms/{vm}/pause")
        before = _families((await operator.get("/metrics")).text)
        assert (await a.post(f"/v1/runtime/vms/{vm}/resume")).status_code == 200
        await a.post(f"/v1/runtime/vms/{vm}/pause")
        resp = await operator.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    fams = _families(resp.text)

    def value(family: str, sample: str, **labels: str) -> float:
        return next(v for n, lab, v in fams[family] if n == sample and labels.items() <= lab.items())

    resumes_before = [v for n, lab, v in before["pal_resume_seconds"] if n == "pal_resume_seconds_count"]
    assert sum(resumes_before) == 0
    assert value("pal_resume_seconds", "pal_resume_seconds_count", trigger="api") == 1

    assert value("pal_vms", "pal_vms", state="paused") == 1
    assert value("pal_vms", "pal_vms", state="running") == 2  # the two forks
    tenant = env.store.tenant_by_api_key(key)
    assert tenant is not None
    assert value("pal_tenant_slots_used", "pal_tenant_slots_used", tenant=tenant.id) == 2
    assert value("pal_tenant_slots_limit", "pal_tenant_slots_limit", tenant=tenant.id) == 3
    assert value("pal_schedule_seconds", "pal_schedule_seconds_count", boot="cold") == 1
    assert value("pal_pause_seconds", "pal_pause_seconds_count", by="operator") == 2
    assert value("pal_fork_seconds", "pal_fork_seconds_count") == 1
    # only the first exec after the schedule counts
    assert value("pal_first_exec_seconds", "pal_first_exec_seconds_count", after="schedule") == 1
    assert value("pal_node_up", "pal_node_up", node="node-1") == 1
    assert value("pal_snapshot_bytes", "pal_snapshot_bytes", node="node-1", tier="local") > 0
    assert value("pal_s3_queue_depth", "pal_s3_queue_depth", node="node-1") == 0


async def test_prometheus_endpoint_is_for_the_operator_only(env: SchedEnv, tmp_path: Path) -> None:
    """No caller is the operator by its address: loopback without a token is refused too."""
    _, key = env.store.create_tenant("q-user", 3)
    app = create_app(env.sched, env.store, env.settings)
    async with _client(app) as local, _client(app, key) as tenant, _client(app, "guess") as guess:
        refused = await local.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "UNAUTHENTICATED"
        assert "operator token" in refused.json()["error"]["message"]
        assert (await tenant.get("/metrics")).status_code == 403  # a tenant key opens nothing
        assert (await guess.get("/metrics")).status_code == 403
    async with _client(app, OPERATOR, "192.0.2.7") as operator:
        ok = await operator.get("/metrics")
        assert ok.status_code == 200 and "pal_tenant_slots_used" in ok.text
    env.settings.metrics_token = "s3cret-token"
    app = create_app(env.sched, env.store, env.settings)
    async with _client(app, "s3cret-token", "192.0.2.7") as scraper:
        ok = await scraper.get("/metrics")
        assert ok.status_code == 200 and "pal_vms" in ok.text
        assert (await scraper.get("/v1/nodes")).status_code == 403  # it opens /metrics alone
    env.manager.heartbeat_error = ConnectionError("node down")
    async with _client(app, "s3cret-token") as scraper:
        down = await scraper.get("/metrics")
    assert down.status_code == 200
    assert _families(down.text)["pal_node_up"] == [("pal_node_up", {"node": "node-1"}, 0.0)]


async def test_every_node_is_reported_and_a_lost_one_is_down(env: SchedEnv) -> None:
    """A control plane with several nodes shows each by its id: figures for those that
    answer, pal_node_up 0 for one that is lost or does not answer."""
    second, third = FakeManager(node_id="node-2"), FakeManager(node_id="node-3")
    for fake in (second, third):
        env.sched.nodes.use_client(fake.node_id, fake)
        await env.sched.nodes.record(await fake.heartbeat(), url=f"http://127.0.0.1:1/{fake.node_id}")
    second.alive["vm-x"] = FakeVm("vm-x", 1, "t")  # one QEMU there
    env.sched.nodes.set_state("node-3", "lost")
    app = create_app(env.sched, env.store, env.settings)
    async with _client(app, OPERATOR) as operator:
        fams = _families((await operator.get("/metrics")).text)
        up = {lab["node"]: v for _, lab, v in fams["pal_node_up"]}
        assert up == {"node-1": 1, "node-2": 1, "node-3": 0}
        assert {lab["node"]: v for _, lab, v in fams["pal_node_vms_live"]} == {"node-1": 0, "node-2": 1}
        assert {lab["node"] for _, lab, _ in fams["pal_s3_queue_depth"]} == {"node-1", "node-2"}
        assert ("stats", "") not in third.calls  # a lost node is not asked
        env.manager.heartbeat_error = ConnectionError("node down")
        fams = _families((await operator.get("/metrics")).text)
    up = {lab["node"]: v for _, lab, v in fams["pal_node_up"]}
    assert up == {"node-1": 0, "node-2": 1, "node-3": 0}


async def test_s3_queue_depth_counts_the_jobs_waiting_for_an_unreachable_s3(
    env: SchedEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's real figures (NodeRuntime.stats over its snapshot store): S3 jobs that
    cannot reach S3 stay queued and show on /metrics until they are done."""
    mirror = S3Mirror(f"http://127.0.0.1:{free_port()}", "pal-queue", retry_base_s=3600, connect_timeout_s=1)
    snaps = SnapshotStore(tmp_path / "snapshots", mirror, key=b"k" * 32)
    try:
        for sid in ("s1", "s2"):
            mirror.schedule_delete(SnapshotRef("default-0123456789ab", "vm-1", sid))
        runtime = NodeRuntime(Settings(data_dir=tmp_path / "node"), snaps, AccelInfo("tcg", "test"))
        monkeypatch.setattr(env.manager, "stats", runtime.stats)
        app = create_app(env.sched, env.store, env.settings)
        async with _client(app, OPERATOR) as operator:
            fams = _families((await operator.get("/metrics")).text)
    finally:
        snaps.close(timeout=5)
    assert fams["pal_s3_queue_depth"] == [("pal_s3_queue_depth", {"node": "node-1"}, 2.0)]
    # S3 could not be listed: its byte count is unknown, not 0
    assert [lab["tier"] for _, lab, _ in fams["pal_snapshot_bytes"]] == ["local"]


def test_counting_s3_bytes_makes_no_bucket() -> None:
    """A scrape reads: a bucket that does not exist yet counts 0 bytes and stays absent."""
    import boto3
    from moto import mock_aws

    with mock_aws():
        mirror = S3Mirror(None, "pal-not-yet")
        assert mirror.total_bytes() == 0
        assert boto3.client("s3", region_name="us-east-1").list_buckets()["Buckets"] == []
