"""The fleet `pal bench control-plane` measures: a store filled as a long-lived cluster's is
(most sandboxes paused or terminated, a few running), and what each simulated node holds
to match it (the VMs it runs, the snapshots it keeps).

The rows are written with PostgreSQL's COPY, straight into the tables the migrations made,
with the values the scheduler itself writes (states and markers of states.py, the slot
flag, status events along each VM's path, snapshot ids and bytes, metadata, lifetimes).
Ages are spread over 30 days, oldest first, and the states follow age, as they do in a
real fleet: the oldest half terminated (deleted long ago, hidden from lists), then the
paused ones (a tenth of them live-paused by the idle tier, on their node), the newest
twentieth running. One large tenant ("bench", the one the benchmark's API calls use) holds
``big_share`` of the fleet; the rest belong to tenants of ``tenant_size`` VMs each.
"""

from __future__ import annotations

import io
import json
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pal.scheduler.views import OFFLOADED_PAUSE
from pal.sizes import DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB, DEFAULT_VCPUS
from pal.store import Store, books
from pal.store.store import hash_api_key, new_api_key
from pal_tools.bench.simnode import SIM_AGENT_VERSION, SIM_IMAGE, SIM_SNAPSHOT_BYTES

BIG_TENANT = "bench"
TEAMS = 50  # metadata "team": one of these (a list filter that keeps 2 %)
JOBS = 997  # metadata "job": one of these (0.1 %)
LIMITS = {
    "vcpus": DEFAULT_VCPUS,
    "memory_mib": DEFAULT_MEMORY_MIB,
    "disk_mib": DEFAULT_DISK_MIB,
    "egress_mbps": None,
    "max_connections": 256,
}


@dataclass(frozen=True)
class FleetPlan:
    records: int
    nodes: int
    running: float = 0.05
    paused: float = 0.45  # the rest is terminated
    live_share: float = 0.1  # of the paused: live-paused by the idle tier (QEMU kept)
    big_share: float = 0.2  # of every record: the benchmark tenant's
    tenant_size: int = 2000
    age_days: float = 30.0
    seed: int = 35
    label: str = BIG_TENANT  # the large tenant's name, and what the others' ids start with
    node_prefix: str = "sim"  # the nodes are <prefix>0000, <prefix>0001...


@dataclass
class Fleet:
    """What :func:`fill` made: the benchmark tenant, a sample of its VMs by kind, the
    metadata values to filter on, and each node's seed (simnodes.py)."""

    tenant_id: str
    api_key: str
    tenants: int
    vms_by_state: dict[str, int]
    sample: dict[str, list[str]]  # running / paused / terminated -> some of the big tenant's
    node_ids: list[str]
    seeds: dict[str, dict[str, Any]]
    events: int
    team: str = "t7"
    job: str = "j11"
    node_memory_mib: int = 0
    fill_secs: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def node_name(i: int, prefix: str = "sim") -> str:
    return f"{prefix}{i:04d}"


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ")


def _copy_text(rows: list[tuple[Any, ...]]) -> bytes:
    """Rows in COPY's text format (\\N for NULL, backslash-escaped text)."""
    out = io.StringIO()
    for row in rows:
        cells = []
        for v in row:
            if v is None:
                cells.append("\\N")
            else:
                s = v if isinstance(v, str) else str(v)
                cells.append(s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n"))
        out.write("\t".join(cells) + "\n")
    return out.getvalue().encode()


def libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


VM_COLUMNS = (
    "vm_id tenant_id state marker reason image agent_version_id limits idle_timeout_secs secrets boot "
    "created_at updated_at snapshot_id parent_vm_id mem_snapshot_id incarnation token holds_slot paused_by "
    "node_id last_activity_unix_ms egress egress_stats placement wait_pause idle_live_pause_secs paused_at "
    "live_stats snapshot_bytes metadata lifetime_ends_at on_lifetime_end listed snapshot_nodes"
).split()
EVENT_COLUMNS = "vm_id tenant_id at kind from_state to_state marker reason".split()
TAG_COLUMNS = "tenant_id tag created_at vm_id".split()


def _path(state: str, marker: str) -> list[tuple[str | None, str, str, str]]:
    """The status events of a VM that ended in ``state``: (from, to, marker, reason)."""
    up = [
        (None, "pending", "", "scheduled"),
        ("pending", "spawning", "scheduler:spawning", "placed"),
        ("spawning", "running", "", "up"),
    ]
    if state == "running":
        return up
    if state == "paused" and marker:
        return [*up, ("running", "paused", marker, "live-paused (idle)")]
    if state == "paused":
        return [
            *up,
            ("running", "draining", "scheduler:idle-pausing", "auto-suspended"),
            ("draining", "paused", "", "auto-suspended (idle timeout)"),
        ]
    return [
        *up,
        ("running", "draining", "scheduler:deleting", "deleting"),
        ("draining", "terminated", "", "deleted"),
    ]


def _live_stats(paused_ms: int) -> dict[str, int]:
    """A live pause of the idle tier offloaded, as the leader counted it (views.py): the
    simulated node reports it offloaded since ``paused_ms``."""
    return {"livePauses": 1, "offloads": 1, "freedMib": 0, OFFLOADED_PAUSE: paused_ms * 1000}


def _tenants(plan: FleetPlan) -> tuple[int, int]:
    """(VMs of the big tenant, number of small tenants)."""
    big = int(plan.records * plan.big_share)
    rest = plan.records - big
    return big, max(1, -(-rest // plan.tenant_size))


def fill(url: str, plan: FleetPlan, *, now: datetime | None = None, batch: int = 20_000) -> Fleet:
    """Write the fleet into the (migrated) database at ``url``; returns what was made. A
    second fleet (another ``label`` and ``seed``) adds to the first."""
    t0 = time.monotonic()
    store = Store(url, run_migrations=False)
    try:
        big, key = store.create_tenant(
            plan.label, 10_000_000, max_paused=10_000_000, max_snapshot_bytes=1 << 60
        )
    finally:
        store.close()
    maker = _Maker(plan, now or datetime.now(UTC), big.id)
    conn = psycopg.connect(libpq_url(url))
    try:
        with conn.cursor() as cur:
            ids = maker.tenant_ids
            cur.execute(
                "INSERT INTO tenants (id, name, api_key_sha256, max_vms, created_at) "
                "SELECT unnest(%s::text[]), unnest(%s::text[]), unnest(%s::text[]), 1000000, %s",
                (
                    ids,
                    [f"fleet-{t}" for t in ids],
                    [hash_api_key(new_api_key()) for _ in ids],
                    _iso(maker.now),
                ),
            )
        conn.commit()
        rows: list[tuple[Any, ...]] = []
        events: list[tuple[Any, ...]] = []
        tags: list[tuple[Any, ...]] = []
        for i in range(plan.records):
            maker.vm(i, rows, events, tags)
            if len(rows) >= batch or i == plan.records - 1:
                _copy(conn, rows, events, tags)
    finally:
        conn.close()
    recount(url)
    analyze(url)
    return maker.fleet(key, time.monotonic() - t0)


def _copy(conn: psycopg.Connection[Any], *batches: list[tuple[Any, ...]]) -> None:
    """Each batch (VM rows, their events, their tags) in its table, one COPY each; emptied."""
    with conn.cursor() as cur:
        for (table, cols), rows in zip(
            (("vms", VM_COLUMNS), ("events", EVENT_COLUMNS), ("vm_tags", TAG_COLUMNS)), batches, strict=True
        ):
            with cur.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as cp:
                cp.write(_copy_text(rows))
            rows.clear()
    conn.commit()


class _Maker:
    """The fleet's VMs, one at a time, and what each node holds to match."""

    def __init__(self, plan: FleetPlan, now: datetime, big_tenant: str) -> None:
        self.plan, self.now, self.big = plan, now, big_tenant
        self.rng = random.Random(plan.seed)
        big_n, small = _tenants(plan)
        self.tenant_ids = [f"t-{plan.label}{i:06d}" for i in range(small)]
        n = plan.records
        self.n_term = n - int(n * plan.running) - int(n * plan.paused)
        self.n_paused = int(n * plan.paused)
        self.nodes = [node_name(i, plan.node_prefix) for i in range(plan.nodes)]
        live_per_node = -(
            -(int(n * plan.running) + int(self.n_paused * plan.live_share)) // max(1, plan.nodes)
        )
        # Room on every node for what it runs and what the benchmark schedules (4x, 256 VMs more).
        self.node_memory = max(64 * 1024, (live_per_node * 4 + 256) * DEFAULT_MEMORY_MIB)
        self.seeds: dict[str, dict[str, Any]] = {
            nd: {"nodeId": nd, "memoryMib": self.node_memory, "running": [], "snapshots": []}
            for nd in self.nodes
        }
        # The big tenant's VMs are spread through the fleet's ages, as a tenant's are.
        self.big_at = set(self.rng.sample(range(n), big_n))
        self.by_state = {"running": 0, "paused": 0, "terminated": 0}
        self.sample: dict[str, list[str]] = {}
        self.events = 0
        self._small = 0

    def _id(self, prefix: str) -> str:
        return prefix + uuid.UUID(int=self.rng.getrandbits(128)).hex[:24]

    def _state(self, i: int) -> tuple[str, str]:
        if i < self.n_term:
            return "terminated", ""
        if i < self.n_term + self.n_paused:
            return "paused", ("live:idle" if self.rng.random() < self.plan.live_share else "")
        return "running", ""

    def _tenant(self, i: int) -> str:
        if i in self.big_at:
            return self.big
        self._small += 1
        return self.tenant_ids[self._small % len(self.tenant_ids)]

    def vm(self, i: int, rows: list[Any], events: list[Any], tags: list[Any]) -> None:
        rng, now = self.rng, self.now
        created = now - timedelta(days=self.plan.age_days) * (1 - i / self.plan.records)
        state, marker = self._state(i)
        tenant, vm_id, node = self._tenant(i), self._id("vm-"), self.nodes[rng.randrange(len(self.nodes))]
        holds = state == "running" or marker == "live:idle"
        snap = self._id("snap-") if state == "paused" and not marker else None
        updated = created + timedelta(minutes=rng.uniform(1, 120)) if state == "terminated" else created
        if marker:  # a live pause of the idle tier is recent: its snapshot tier comes within the hour
            updated = now - timedelta(minutes=rng.uniform(1, 20))
        timeout = 3600 if marker or rng.random() < 0.5 else 0
        last_ms = int(now.timestamp() * 1000) if state == "running" else int(updated.timestamp() * 1000)
        lifetime = None
        if rng.random() < 0.1:  # a tenth were given one; a deleted VM keeps its own
            ends = created + timedelta(days=rng.uniform(1, 60))
            lifetime = _iso(ends if state == "terminated" else max(ends, now + timedelta(days=1)))
        meta = {"team": f"t{i % TEAMS}", "job": f"j{i % JOBS}", "env": "prod" if i % 4 else "dev"}
        listed = state != "terminated"  # deleted long ago: out of the list (retention.py)
        rows.append(
            (
                vm_id, tenant, state, marker, None, SIM_IMAGE, SIM_AGENT_VERSION, json.dumps(LIMITS),
                timeout, "{}", "auto", _iso(created), _iso(updated), snap, None, None, 1, self._id(""),
                "true" if holds else "false", "idle" if state == "paused" else None, node, last_ms, '"none"',
                "{}", None, None, 1800 if timeout else 0, _iso(updated) if state == "paused" else None,
                json.dumps(_live_stats(last_ms) if marker else {}),
                SIM_SNAPSHOT_BYTES if snap else 0, json.dumps(meta), lifetime, "delete",
                "true" if listed else "false", json.dumps([node] if snap else []),
            )
        )  # fmt: skip
        path = _path(state, marker)
        events += [(vm_id, tenant, _iso(created), "status", *step) for step in path]
        if listed:
            tags += [(tenant, f"{k}={v}", _iso(created), vm_id) for k, v in sorted(meta.items())]
        self.events += len(path)
        self.by_state[state] += 1
        if holds:
            self.seeds[node]["running"].append([vm_id, tenant, 1, last_ms, "idle" if marker else None])
        if snap:
            self.seeds[node]["snapshots"].append([vm_id, snap])
        kind = state if not marker else "live"
        if tenant == self.big and len(self.sample.setdefault(kind, [])) < 2000:
            self.sample[kind].append(vm_id)

    def fleet(self, key: str, secs: float) -> Fleet:
        return Fleet(
            tenant_id=self.big,
            api_key=key,
            tenants=len(self.tenant_ids) + 1,
            vms_by_state=self.by_state,
            sample=self.sample,
            node_ids=self.nodes,
            seeds=self.seeds,
            events=self.events,
            node_memory_mib=self.node_memory,
            fill_secs=round(secs, 1),
        )


def recount(url: str) -> None:
    """The tenants' running counts (pal/store/books.py) of the rows COPY wrote."""
    store = Store(url, run_migrations=False)
    try:
        with store.engine.begin() as conn:
            books.recount(conn)
    finally:
        store.close()


def analyze(url: str) -> None:
    """What a fleet's database has after autovacuum: planner statistics and a visibility map."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def split_seeds(fleet: Fleet, processes: int) -> Iterator[list[dict[str, Any]]]:
    """The nodes' seeds in ``processes`` groups (one per simnodes.py process)."""
    ids = fleet.node_ids
    for k in range(processes):
        group = [fleet.seeds[nd] for nd in ids[k::processes]]
        if group:
            yield group
