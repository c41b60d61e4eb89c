"""`pal bench control-plane`: the control plane at 10^4, 10^5 and 10^6 sandbox records, on one
machine, with simulated nodes and a real PostgreSQL (docs/scale.md).

One size (``--records N --nodes M``), or the ladder (10^4 x 10, 10^5 x 100, 10^6 x 1000):

1. PostgreSQL 15 (Debian's initdb/pg_ctl in a temp dir) with its durability on (fsync,
   synchronous commit, full page writes) and pg_stat_statements; the schema by the
   migrations; the fleet written (fleet.py: 5 % running, 45 % paused, 50 % terminated,
   their status events, snapshots, metadata and lifetimes).
2. Two `pal server` replicas (real processes), and M simulated nodes (simnode.py) in a few
   processes, each on the real node RPC, pushing real heartbeats.
3. Idle: the leader's loops tick by tick (time, CPU, store statements and rows: its
   ``/healthz`` details), with nothing but the nodes' heartbeats going on.
4. Operations through both replicas (a follower forwards): schedules for ``--seconds``,
   then pause, resume, fork and delete of those VMs; each call's latency, less what the
   simulated node took (the control plane's own time).
5. Reads: GET of the tenant's VMs, list pages by cursor, the metadata filter.
6. PostgreSQL: rows and bytes of each table and index, statements per operation, the
   slowest statements, sequential scans.
7. Failover: kill -9 of the leader; until the other replica leads, and until it has
   reconciled every node.

Writes ``<out-dir>/control-plane.json`` (every size run so far in that file is kept, the
new one replaces its own size) and ``<out-dir>/control-plane.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from pal.store import Store
from pal_tools.bench.common import machine
from pal_tools.bench.cp_load import Load, OpResult, operations, reads
from pal_tools.bench.cp_pg import BENCH_SETTINGS, PgFigures
from pal_tools.bench.cp_report import render
from pal_tools.bench.cpu import CpuMeter, children_of, cpu_secs
from pal_tools.bench.fleet import Fleet, FleetPlan, fill, split_seeds
from pal_tools.bench.plans import hot_reads
from pal_tools.bench.simnode import SimTimes
from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import LocalCluster, Proc
from pal_tools.localcluster.throwaway import free_port

LADDER = ((10_000, 10), (100_000, 100), (1_000_000, 1000))
NODES_PER_PROCESS = 250
Log = Callable[[str], None]


@dataclass(frozen=True)
class Options:
    seconds: float = 20.0  # of schedules
    idle_secs: float = 30.0
    concurrency: int = 32
    sample: int = 300  # of the scheduled VMs: paused, resumed
    forks: int = 50
    reads: int = 500
    replicas: int = 2
    processes: int = 0  # simulated-node processes (0: one per 250 nodes, at most 4)
    heartbeat_s: float = 5.0
    times: SimTimes = field(default_factory=SimTimes)


@dataclass
class Run:
    """The processes of one size's run, and how to reach them."""

    base: Path
    cluster: LocalCluster
    sims: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def admin_get(self, p: Proc, path: str) -> Any:
        r = httpx.get(
            p.url + path, headers={"Authorization": f"Bearer {self.cluster.admin_token}"}, timeout=60
        )
        r.raise_for_status()
        return r.json()

    def leader_health(self) -> tuple[Proc, dict[str, Any]]:
        p = self.cluster.wait_leader(60)
        return p, self.admin_get(p, "/healthz")

    def reconciled(self) -> tuple[Proc, dict[str, Any]] | None:
        """The leader and its details once it has reconciled every node, else None."""
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            leader, health = self.leader_health()
            return (leader, health) if health.get("reconciled") else None
        return None

    def stop(self) -> None:
        for s in self.sims:
            if s.poll() is None:
                s.send_signal(signal.SIGTERM)
        for s in self.sims:
            try:
                s.wait(30)
            except subprocess.TimeoutExpired:
                s.kill()
        self.cluster.stop_all()


def _rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def _wait(what: str, fn: Callable[[], Any], timeout: float, every: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every)


def _nodes_seen(pgf: PgFigures, since: datetime) -> int:
    row = pgf.conn.execute(
        "SELECT count(*) FROM nodes WHERE state = 'active' AND last_seen_at >= %s",
        (since.astimezone(UTC).replace(tzinfo=None),),
    ).fetchone()
    return int(row[0]) if row else 0


def start_cluster(
    run: Run, pgf: PgFigures, fleet: Fleet, opts: Options, log: Log
) -> tuple[Proc, dict[str, Any]]:
    """The replicas, then the simulated nodes; returns once every node has registered and
    the leader has reconciled them: the leader and its /healthz details."""
    c, nodes = run.cluster, len(fleet.node_ids)
    for i in range(opts.replicas):
        c.start_replica(f"r{i + 1}")
        c.wait_leader(300)
    start_sims(run, fleet, opts, log)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    _wait("every node registered", lambda: _nodes_seen(pgf, epoch) >= nodes, 600)
    got: tuple[Proc, dict[str, Any]] = _wait("the leader reconciled", run.reconciled, 900)
    return got


def loop_window(run: Run, ticks: int, loop: str = "idle_sweep", timeout: float = 600) -> dict[str, Any]:
    """Each leader loop's ticks while ``loop`` ticks ``ticks`` more times (_loop_delta)."""
    _, health = run.leader_health()
    before = health["loops"]
    start = before.get(loop, {}).get("ticks", 0)

    def done() -> dict[str, Any] | None:
        _, h = run.leader_health()
        return h["loops"] if h["loops"].get(loop, {}).get("ticks", 0) >= start + ticks else None

    after: dict[str, Any] = _wait(f"{ticks} ticks of {loop}", done, timeout, every=0.1)
    return _loop_delta(after, before)


def start_sims(run: Run, fleet: Fleet, opts: Options, log: Log) -> None:
    procs = opts.processes or min(4, max(1, -(-len(fleet.node_ids) // NODES_PER_PROCESS)))
    servers = [p.url for p in run.cluster.replicas.values()]
    t = opts.times
    for k, group in enumerate(split_seeds(fleet, procs)):
        seed = run.base / f"sim{k}.json"
        seed.write_text(json.dumps(group))
        argv = [
            sys.executable,
            "-m",
            "pal_tools.bench.simnodes",
            "--seed",
            str(seed),
            "--port",
            str(free_port()),
        ]
        for s in servers:
            argv += ["--server", s]
        argv += ["--interval", str(opts.heartbeat_s), "--spawn-ms", str(t.spawn_ms), "--restore-ms",
                 str(t.restore_ms), "--snapshot-ms", str(t.snapshot_ms), "--stop-ms", str(t.stop_ms),
                 "--exec-ms", str(t.exec_ms)]  # fmt: skip
        env = {**os.environ, "PAL_CLUSTER_SECRET": run.cluster.secret}
        with open(run.base / f"sim{k}.log", "ab") as out:
            run.sims.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
    log(f"{len(run.sims)} simulated-node processes for {len(fleet.node_ids)} nodes")


def _loop_delta(
    after: dict[str, Any], before: dict[str, Any], cpu_share: float | None = None
) -> dict[str, Any]:
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        ticks = a["ticks"] - b.get("ticks", 0)
        if ticks <= 0:
            continue
        out[name] = {
            "ticks": ticks,
            "meanSecs": round((a["secs"] - b.get("secs", 0)) / ticks, 4),
            "maxSecs": a["maxSecs"],
            "cpuSecsPerTick": round((a["cpuSecs"] - b.get("cpuSecs", 0)) / ticks, 4),
            "rowsPerTick": round((a["rows"] - b.get("rows", 0)) / ticks, 1),
            "statementsPerTick": round((a["statements"] - b.get("statements", 0)) / ticks, 1),
            "maxRows": a["maxRows"],
        }
    return out


def _per_op(stmts: list[dict[str, Any]], ops: int, idle_rate: float, secs: float) -> dict[str, Any]:
    calls = sum(s["calls"] for s in stmts)
    net = max(0.0, calls - idle_rate * secs)
    return {
        "all": calls,
        "perOp": round(net / ops, 1) if ops else None,
        "top": stmts[:5],
    }


def run_size(records: int, nodes: int, opts: Options, log: Log) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="pal-cp-"))
    os.chmod(base, 0o700)
    result: dict[str, Any] = {"records": records, "nodes": nodes, "options": asdict(opts)}
    result["loadStart"] = round(os.getloadavg()[0], 2)
    with LocalPostgres(durable=True, settings=BENCH_SETTINGS) as pg:
        Store(pg.url).close()  # the schema, by the migrations
        pgf = PgFigures(pg.url)
        result["postgres"] = pgf.settings()
        log(f"filling {records} records for {nodes} nodes")
        fleet = fill(pg.url, FleetPlan(records, nodes))
        log(f"filled in {fleet.fill_secs} s: {fleet.vms_by_state}, {fleet.events} events")
        result["fleet"] = {
            "vmsByState": fleet.vms_by_state,
            "events": fleet.events,
            "tenants": fleet.tenants,
            "fillSecs": fleet.fill_secs,
            "nodeMemoryMib": fleet.node_memory_mib,
        }
        env = {
            "PAL_LOG_LEVEL": "WARNING",
            "PAL_NODE_HEARTBEAT_INTERVAL": str(opts.heartbeat_s),
            "PAL_MAX_FORK_COUNT": "8",
        }
        cluster = LocalCluster(base=base, database_url=pg.url, shared_images=base, extra_env=env)
        sr = SizeRun(Run(base, cluster), pgf, fleet, opts, log, result)
        try:
            sr.phases()
        except Exception as exc:  # the size is not held: what broke, and where
            sr.show_logs()
            result["notHeld"] = {
                "phase": sr.phase,
                "error": f"{type(exc).__name__}: {exc}"[:400],
                **sr.damage(),
            }
            log(f"not held at {records} records, {nodes} nodes: {result['notHeld']}")
        except BaseException:
            sr.show_logs()
            raise
        finally:
            sr.run.stop()
            pgf.close()
            shutil.rmtree(base, ignore_errors=True)
    result["loadDuring"] = [round(x, 2) for x in sr.loads]
    result["loadEnd"] = round(os.getloadavg()[0], 2)
    return summarize(result)


@dataclass
class SizeRun:
    """The phases of one size's run, each adding to ``result``."""

    run: Run
    pgf: PgFigures
    fleet: Fleet
    opts: Options
    log: Log
    result: dict[str, Any]
    loads: list[float] = field(default_factory=list)
    phase: str = "start"

    def phases(self) -> None:
        self.start()
        self.phase = "idle"
        idle_rate = self.idle()
        urls = [p.url for p in self.run.cluster.replicas.values()]
        self.phase = "operations"
        self.operations(urls, idle_rate)
        self.phase = "reads"
        self.reads(urls)
        self.phase = "failover"
        self.result["sizes"] = self.pgf.sizes()
        self.result["scansTotal"] = PgFigures.scans_minus(self.pgf.scans(), {})
        self.result["plans"] = _plans(self.pgf, self.fleet)
        self.result["failover"] = failover(self.run, self.pgf, len(self.fleet.node_ids), self.log)
        self.loads.append(os.getloadavg()[0])

    def start(self) -> None:
        c, nodes = self.run.cluster, len(self.fleet.node_ids)
        t0 = time.monotonic()
        for i in range(self.opts.replicas):
            c.start_replica(f"r{i + 1}")
            c.wait_leader(300)
        start_sims(self.run, self.fleet, self.opts, self.log)
        epoch = datetime(1970, 1, 1, tzinfo=UTC)
        _wait("every node registered", lambda: _nodes_seen(self.pgf, epoch) >= nodes, 600)
        leader, health = _wait("the leader reconciled", self._reconciled, 900)
        self.result["startupSecs"] = round(time.monotonic() - t0, 1)
        self.log(
            f"{nodes} nodes registered, leader {leader.name} reconciled ({self.result['startupSecs']} s)"
        )
        self.result["takeoverTick"] = health.get("loops", {}).get("takeover")

    def _reconciled(self) -> tuple[Proc, dict[str, Any]] | None:
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            leader, health = self.run.leader_health()
            return (leader, health) if health.get("reconciled") else None
        return None

    def idle(self) -> float:
        """Nothing but the nodes' heartbeats: each loop's ticks. The statements per second
        of this background (subtracted from the operations')."""
        leader, health = self.run.leader_health()
        before, st0, sc0, cpu0 = (
            health["loops"],
            self.pgf.statements(),
            self.pgf.scans(),
            cpu_secs(leader.proc.pid),
        )
        t0 = time.monotonic()
        time.sleep(self.opts.idle_secs)
        self.loads.append(os.getloadavg()[0])
        secs = time.monotonic() - t0
        leader, health = self.run.leader_health()
        stmts = self.pgf.statements().minus(st0)
        rate = sum(s["calls"] for s in stmts) / secs
        self.result["idle"] = {
            "secs": round(secs, 1),
            "loops": _loop_delta(health["loops"], before),
            "leaderCpuPct": round((cpu_secs(leader.proc.pid) - cpu0) / secs * 100, 1),
            "eventLoopLagMaxSecs": health.get("eventLoopLagMaxSecs"),
            "statementsPerSec": round(rate, 1),
            "scans": PgFigures.scans_minus(self.pgf.scans(), sc0),
            "top": stmts[:8],
        }
        self.result["leaderRssMibIdle"] = _rss_mib(leader.proc.pid)
        self.log(f"idle: {json.dumps(self.result['idle']['loops'])}")
        return rate

    def operations(self, urls: list[str], idle_rate: float) -> None:
        cpu = self.cpu_meter()
        ops = asyncio.run(_operations(urls, self.fleet.api_key, self.opts, self.pgf, idle_rate, cpu))
        self.loads.append(os.getloadavg()[0])
        self.result["operations"] = ops
        leader, health = self.run.leader_health()
        self.result["loopsAfterOps"] = health["loops"]
        self.result["eventLoopLagMaxSecs"] = health.get("eventLoopLagMaxSecs")
        self.result["leaderRssMibAfterOps"] = _rss_mib(leader.proc.pid)
        shown = [
            f"{k} {v['perSec']}/s p99 {v['cpP99Ms']} ms, {v['errors']} errors"
            for k, v in ops.items()
            if not k.startswith("_")
        ]
        self.log("operations: " + ", ".join(shown))

    def reads(self, urls: list[str]) -> None:
        sample = [
            v for k in ("running", "paused", "live", "terminated") for v in self.fleet.sample.get(k, [])
        ]
        rd = asyncio.run(_reads(urls, self.fleet, sample, self.opts))
        self.result["reads"] = rd
        self.log("reads: " + ", ".join(f"{k} p50 {v['p50Ms']} p99 {v['p99Ms']} ms" for k, v in rd.items()))

    def damage(self) -> dict[str, Any]:
        """What the control plane did meanwhile that it should not have: nodes it declared
        lost, VMs it failed (the simulated nodes never fail)."""
        conn = self.pgf.conn
        lost = conn.execute("SELECT count(*) FROM nodes WHERE state = 'lost'").fetchone()
        failed = conn.execute("SELECT count(*) FROM vms WHERE state = 'failed'").fetchone()
        return {"nodesLost": int(lost[0]) if lost else 0, "vmsFailed": int(failed[0]) if failed else 0}

    def cpu_meter(self) -> CpuMeter:
        """The leader, the followers, PostgreSQL, the simulated nodes, this process (the load)."""
        c = self.run.cluster

        def replicas(lead: bool) -> list[int]:
            leader = c.leader()
            return [p.proc.pid for p in c.replicas.values() if p.alive() and (p is leader) == lead]

        pg = self.pgf.conn.execute("SELECT pg_backend_pid()").fetchone()
        postmaster = int(Path(f"/proc/{pg[0]}/stat").read_text().rsplit(")", 1)[1].split()[1]) if pg else 0
        return CpuMeter(
            {
                "leader": lambda: replicas(True),
                "followers": lambda: replicas(False),
                "postgres": lambda: [postmaster, *children_of(postmaster)],
                "nodes": lambda: [s.pid for s in self.run.sims],
                "load": lambda: [os.getpid()],
            }
        )

    def show_logs(self) -> None:
        for p in self.run.cluster.replicas.values():
            self.log(f"--- {p.name} ({p.log_path}):\n{p.log_tail(30)}")
        for k in range(len(self.run.sims)):
            with contextlib.suppress(OSError):
                tail = (self.run.base / f"sim{k}.log").read_text().splitlines()[-15:]
                self.log(f"--- sim{k}:\n" + "\n".join(tail))


async def _operations(
    urls: list[str], key: str, opts: Options, pgf: PgFigures, idle_rate: float, cpu: CpuMeter
) -> dict[str, Any]:
    """Each operation's figures, the statements each ran per call (those of its window,
    less the background's rate) and the CPU each component spent per call."""
    load = Load(urls, key, opts.concurrency)
    marks = [pgf.statements()]
    cpus = [cpu.read()]

    def mark(_op: str) -> None:
        marks.append(pgf.statements())
        cpus.append(cpu.read())

    try:
        got = await operations(
            load, seconds=opts.seconds, sample=opts.sample, forks=opts.forks, times=opts.times, mark=mark
        )
    finally:
        await load.aclose()
    out: dict[str, Any] = {}
    for i, (name, r) in enumerate(got.items()):
        out[name] = r.summary()
        stmts = marks[i + 1].minus(marks[i])
        out[name]["statements"] = _per_op(stmts, r.ok, idle_rate, r.seconds)
        out[name]["cpuMsPerCall"] = CpuMeter.per_call(cpus[i + 1], cpus[i], r.ok)
    return out


async def _reads(urls: list[str], fleet: Fleet, sample: list[str], opts: Options) -> dict[str, Any]:
    load = Load(urls, fleet.api_key, 8)
    try:
        got: dict[str, OpResult] = await reads(load, sample, team=fleet.team, job=fleet.job, n=opts.reads)
        return {k: v.summary() for k, v in got.items()}
    finally:
        await load.aclose()


def _plans(pgf: PgFigures, fleet: Fleet) -> dict[str, str]:
    """The query plans of the hot reads, as PostgreSQL chose them here."""
    vm = (fleet.sample.get("paused") or ["vm-0"])[0]
    out = {}
    for name, (sql, params) in hot_reads(fleet.tenant_id, fleet.team, fleet.node_ids[0], vm).items():
        try:
            out[name] = pgf.explain(sql, params)
        except Exception as exc:
            out[name] = f"(not explained: {exc})"
    return out


def failover(run: Run, pgf: PgFigures, nodes: int, log: Log) -> dict[str, Any]:
    c = run.cluster
    old = c.wait_leader(60)
    killed_at = datetime.now(UTC)
    t0 = time.monotonic()
    c.kill(old)
    new = c.wait_leader(120, exclude=old)
    took = time.monotonic() - t0

    def reconciled() -> bool:
        with contextlib.suppress(Exception):
            return (
                bool(run.admin_get(new, "/healthz").get("reconciled"))
                and _nodes_seen(pgf, killed_at) >= nodes
            )
        return False

    _wait("every node reconciled by the new leader", reconciled, 900)
    settled = time.monotonic() - t0
    health = run.admin_get(new, "/healthz")
    log(f"failover: {took:.2f} s to a new leader, {settled:.2f} s until every node was reconciled")
    return {
        "secs": round(took, 2),
        "reconciledSecs": round(settled, 2),
        "leaseSecs": 5.0,
        "takeoverTick": health.get("loops", {}).get("takeover"),
        "leaderRssMib": _rss_mib(new.proc.pid),
    }


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """The figures compared from run to run, next to everything measured."""
    ops, rd = r.get("operations", {}), r.get("reads", {})
    lists = [k for k in ("list", "listTeam", "listJob") if k in rd]
    steady = {k: v for k, v in r.get("loopsAfterOps", {}).items() if k != "takeover"}
    return {
        "records": r["records"],
        "nodes": r["nodes"],
        "schedulesPerSec": ops.get("schedule", {}).get("perSec"),
        "scheduleP50Ms": ops.get("schedule", {}).get("cpP50Ms"),
        "scheduleP99Ms": ops.get("schedule", {}).get("cpP99Ms"),
        "getP99Ms": rd.get("get", {}).get("p99Ms"),
        "listPageP99Ms": max((rd[k]["p99Ms"] or 0 for k in lists), default=None),
        "maxTickSecs": max((v["maxSecs"] for v in steady.values()), default=None),
        "failoverSecs": r.get("failover", {}).get("secs"),
        "reconciledSecs": r.get("failover", {}).get("reconciledSecs"),
        "leaderRssMib": r.get("leaderRssMibAfterOps"),
        **r,
    }


def main(records: int | None, nodes: int | None, out_dir: Path, opts: Options) -> None:
    def log(msg: str) -> None:
        print(f"[{datetime.now(UTC):%H:%M:%S}] {msg}", flush=True)

    sizes = [(records, nodes or max(10, records // 1000))] if records else list(LADDER)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "control-plane.json"
    report: dict[str, Any] = {"sizes": []}
    with contextlib.suppress(OSError, ValueError):
        report = json.loads(path.read_text())
    report["machine"] = machine()
    for n, m in sizes:
        log(f"== {n} records, {m} nodes (load {os.getloadavg()[0]:.2f})")
        got = run_size(n, m, opts, log)
        got["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        report["sizes"] = [s for s in report.get("sizes", []) if (s["records"], s["nodes"]) != (n, m)] + [got]
        report["sizes"].sort(key=lambda s: (s["records"], s["nodes"]))
        path.write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "control-plane.md").write_text(render(report))
        log(f"wrote {path}")
    print(render(report))
