"""`pal bench cluster`: the cluster measured on one machine, with real processes.

Starts PostgreSQL (initdb/pg_ctl in a temp dir), an S3 server (moto), two `pal server`
replicas and up to three `pal node`s (data dirs under one temp dir on the test data dir's
reflink file system), and measures through the public API:

- schedule throughput (VMs/s): N schedules, 4 in flight, with 1 node and then with 3;
- leader failover: kill -9 of the leader until the other replica reports itself leader
  (p50 of 10), next to the lease TTL it is bounded by;
- resume on another node from S3 (the node downloads and verifies the snapshot) vs a resume
  on the VM's own node (local snapshot), p50 of N each, the pause's upload to S3 waited for
  first so the remote figure is the download + restore.

Writes docs/benchmarks/cluster.{json,md}. Numbers come with the machine and its load.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import os
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import boto3

from pal.config import Settings
from pal.store import Store
from pal_tools.bench.common import Api, machine, pct, poll_until
from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import LocalCluster, kill_qemus_under
from pal_tools.localcluster.s3 import TEST_ENV, S3Server


def _s3_has(s3: Any, bucket: str, vm_id: str, snapshot_id: str) -> bool:
    try:
        keys = s3.list_objects_v2(Bucket=bucket, Prefix="snapshots/").get("Contents", [])
    except Exception:
        return False
    return any(k["Key"].endswith(f"/{vm_id}/{snapshot_id}/meta.json") for k in keys)


def throughput(api: Api, n: int, spec: dict[str, Any]) -> dict[str, float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        vms = list(pool.map(lambda _: api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"], range(n)))
    took = time.perf_counter() - t0
    for vm in vms:
        api.call("DELETE", f"/v1/runtime/vms/{vm}")
    return {"vms": n, "seconds": round(took, 2), "vmsPerSecond": round(n / took, 3)}


def failovers(c: LocalCluster, n: int, log: Any) -> list[float]:
    out = []
    for i in range(n):
        leader = c.wait_leader(30)
        t0 = time.monotonic()
        c.kill(leader)
        c.wait_leader(30, exclude=leader)
        out.append(time.monotonic() - t0)
        log(f"failover {i + 1}/{n}: {out[-1]:.2f} s")
        back = c.restart(leader)
        poll_until("restarted replica", lambda b=back: c.health(b), 60)
    return out


def resumes(c: LocalCluster, api: Api, s3: Any, n: int, log: Any) -> dict[str, list[float]]:
    """Alternate: pause, resume on the same node (local); pause, drain that node, resume
    (lands on the other node, which pulls the snapshot from S3); reactivate."""
    vm = api.call("POST", "/v1/runtime/schedule", json={"placement": {"region": "bench"}})["vmId"]
    store = Store(c.database_url, run_migrations=False)
    local: list[float] = []
    remote: list[float] = []
    try:
        for i in range(n):
            snap = api.call("POST", f"/v1/runtime/vms/{vm}/pause")["snapshotId"]
            t = time.perf_counter()
            api.call("POST", f"/v1/runtime/vms/{vm}/resume")
            local.append((time.perf_counter() - t) * 1000)
            api.exec_ok(vm)
            home = store.get_vm(vm).node_id  # type: ignore[union-attr]
            snap = api.call("POST", f"/v1/runtime/vms/{vm}/pause")["snapshotId"]
            poll_until("upload to S3", lambda s=snap: _s3_has(s3, c.s3_bucket, vm, s), 120, 0.1)
            c.admin("POST", f"/v1/nodes/{home}/drain", json={}).raise_for_status()
            t = time.perf_counter()
            api.call("POST", f"/v1/runtime/vms/{vm}/resume")
            remote.append((time.perf_counter() - t) * 1000)
            api.exec_ok(vm)
            c.admin("POST", f"/v1/nodes/{home}/activate").raise_for_status()
            log(f"resume {i + 1}/{n}: local {local[-1]:.0f} ms, from S3 on another node {remote[-1]:.0f} ms")
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vm}")
        store.close()
    return {"local": local, "remote": remote}


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    t1, t3 = r["throughput"]["1 node"], r["throughput"]["3 nodes"]
    f = r["failover_s"]
    loc, rem = r["resume_ms"]["local"], r["resume_ms"]["remote"]
    lines = [
        "# Cluster benchmark",
        "",
        f"`pal bench cluster`, {r['date']}. Machine: {m['cpu']}, {m['cores']} cores, {m['memGiB']} GiB, "
        f"kernel {m['kernel']}, {m['qemu']}, accelerator **{r['accel']}**. Load average at start "
        f"{r['load_start']}, at end {r['load_end']} (other work was running: figures are for this load).",
        "",
        "Everything on one machine: PostgreSQL 15 (throwaway, fsync off), moto as S3, 2 `pal server`",
        "replicas, 3 `pal node`s (TCG guests, 256 MiB). Every figure is measured through the API.",
        "",
        "| measure | value | baseline (same run) | ratio |",
        "|---|---|---|---|",
        f"| schedule throughput, 3 nodes | {t3['vmsPerSecond']} VMs/s ({t3['vms']} VMs) | "
        f"{t1['vmsPerSecond']} VMs/s with 1 node | {t3['vmsPerSecond'] / t1['vmsPerSecond']:.2f}x |",
        f"| leader failover after kill -9, p50 of {len(f)} | {pct(f, 0.5):.2f} s (p90 {pct(f, 0.9):.2f}, "
        f"max {max(f):.2f}) | lease TTL {r['lease_s']} s | {pct(f, 0.5) / r['lease_s']:.2f} |",
        f"| resume on another node from S3, p50 of {len(rem)} | {pct(rem, 0.5):.0f} ms "
        f"(p90 {pct(rem, 0.9):.0f}) | local resume {pct(loc, 0.5):.0f} ms (p90 {pct(loc, 0.9):.0f}) "
        f"| {pct(rem, 0.5) / pct(loc, 0.5):.2f}x |",
        "",
        "Notes:",
        "- Throughput: schedules through one replica, 4 in flight; warm templates on every node. On",
        "  one 2-core machine, 3 nodes share the same CPUs, so the ratio shows the control plane's",
        "  placement overhead and parallelism, not what 3 machines would give.",
        "- Failover is bounded by the lease (`PAL_LEADER_LEASE`): a follower takes an expired lease",
        "  within one renewal tick. A clean stop (SIGTERM) releases the lease at once.",
        "- The remote resume includes the S3 download (sparse objects, checksums verified) and the",
        "  restore; the pause's upload to S3 happened before the clock started.",
        "",
        "Raw samples: `cluster.json` beside this file.",
    ]
    return "\n".join(lines) + "\n"


def main(iterations: int, failover_runs: int, schedules: int, data_dir: Path | None, out_dir: Path) -> None:
    """Needs a built image in the data dir (default PAL_TEST_DATA_DIR or /var/lib/pal-test)."""
    from pal.server import ensure_image, prepare_data_dir

    def log(msg: str) -> None:
        print(msg, flush=True)

    settings = Settings.from_env(data_dir or os.environ.get("PAL_TEST_DATA_DIR") or "/var/lib/pal-test")
    prepare_data_dir(settings)
    ensure_image(settings)
    base = settings.data_dir / "runs" / f"b-{uuid.uuid4().hex[:6]}"
    base.mkdir(parents=True)
    load_start = os.getloadavg()
    os.environ.update(TEST_ENV)
    with LocalPostgres() as pg, S3Server() as s3srv:
        c = LocalCluster(base=base, database_url=pg.url, shared_images=settings.data_dir,
                         s3_endpoint=s3srv.endpoint, s3_bucket="pal-bench",
                         # a loaded host must not turn a slow restore into a failed run
                         extra_env={"PAL_HARNESS_READY_TIMEOUT_MS": "60000"})  # fmt: skip
        s3 = boto3.client("s3", endpoint_url=s3srv.endpoint, region_name="us-east-1")
        try:
            c.start_replica("r1")
            c.wait_leader(60)
            c.start_replica("r2")
            c.start_node("n1", region="bench")
            c.wait_nodes(["n1"], 600)
            store = Store(pg.url, run_migrations=False)
            key = store.create_tenant("bench", 100)[1]
            store.close()
            api = Api(c.wait_leader(30).url, key)
            poll_until("warm template on n1", lambda: c.node_views()["n1"]["warmTemplates"] > 0, 600, 1.0)
            api.exec_ok(api.call("POST", "/v1/runtime/schedule", json={})["vmId"])  # warm caches
            one = throughput(api, schedules, {})
            log(f"throughput, 1 node: {one}")
            c.start_node("n2", region="bench")
            c.start_node("n3")
            c.wait_nodes(["n1", "n2", "n3"], 600)
            poll_until(
                "warm templates", lambda: all(v["warmTemplates"] for v in c.node_views().values()), 600, 1.0
            )
            three = throughput(api, schedules, {})
            log(f"throughput, 3 nodes: {three}")
            rs = resumes(c, api, s3, iterations, log)
            fo = failovers(c, failover_runs, log)
            from pal.vmm.accel import probe

            accel = probe(settings).name  # what the nodes use (cached probe, shared image dir)
        finally:
            c.stop_all()
            kill_qemus_under(base)
            shutil.rmtree(base, ignore_errors=True)
    report = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "accel": accel,
        "load_start": " ".join(f"{x:.2f}" for x in load_start),
        "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "lease_s": Settings.from_env().leader_lease_s,
        "throughput": {"1 node": one, "3 nodes": three},
        "failover_s": [round(x, 3) for x in fo],
        "resume_ms": {k: [round(x, 1) for x in v] for k, v in rs.items()},
        "p50": {
            "failover_s": round(statistics.median(fo), 3),
            "resume_local_ms": round(statistics.median(rs["local"]), 1),
            "resume_remote_ms": round(statistics.median(rs["remote"]), 1),
        },
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cluster.json").write_text(json.dumps(report, indent=2))  # first: the samples are kept
    (out_dir / "cluster.md").write_text(render(report))
    log(render(report))
