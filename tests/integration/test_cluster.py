"""A real cluster on this machine: PostgreSQL (initdb/pg_ctl in a temp dir), an S3 server
(moto), two control-plane replicas (`pal server`) and three nodes (`pal node`), all
separate processes. One cluster for the whole module; tests run in file order.

Timing bounds here are the product's guarantees (failover within 10 s, node loss within
40 s): each is polled for, with the bound as the deadline, and the measured time is printed
(`pytest -s`) rather than slept for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import httpx
import pytest

from pal.store import Store
from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import LocalCluster, Proc, kill_qemus_under, qemu_pids_under
from tests.conftest import TEST_DATA_DIR, PalServer, pal_cli
from tests.leaks import pooled_vms, qemus_by_vm, vm_dir_of
from tests.s3server import S3Server

pytestmark = [pytest.mark.vm, pytest.mark.s3]

SLOT_STATES = {"pending", "spawning", "running", "draining"}


@pytest.fixture(scope="module")
def cluster(
    postgres: LocalPostgres, s3_server: S3Server, pal_server: PalServer, tenant_key: str
) -> Iterator[LocalCluster]:
    """2 replicas, 3 nodes. n1 (eu, disk=ssd) and n2 (eu, pool=b) share the session's warm
    templates (``tenant_key`` made sure they exist); n3 (us, gpu=yes) has none."""
    run = TEST_DATA_DIR / "runs" / f"c-{uuid.uuid4().hex[:6]}"  # short: unix socket paths < 108 bytes
    run.mkdir(parents=True)
    c = LocalCluster(
        base=run,
        database_url=postgres.new_database("cluster"),
        shared_images=TEST_DATA_DIR,
        s3_endpoint=s3_server.endpoint,
        s3_bucket=f"pal-cluster-{uuid.uuid4().hex[:6]}",
        # as conftest (no pre-started QEMUs: they would add load and QEMUs no VM row has)
        extra_env={
            "PAL_IDLE_SWEEP_INTERVAL": "1",
            "PAL_HARNESS_READY_TIMEOUT_MS": "60000",
            "PAL_PRESTART": "0",
        },
    )
    try:
        c.start_replica("r1")
        c.wait_leader(60)
        c.start_replica("r2")
        c.start_node("n1", region="eu", labels={"disk": "ssd"}, memory_mib=2560)
        c.start_node("n2", region="eu", labels={"pool": "b"}, memory_mib=2560)
        c.start_node("n3", region="us", labels={"gpu": "yes"}, memory_mib=2560, templates=False)
        c.wait_nodes(["n1", "n2", "n3"], 300)
        yield c
    finally:
        c.stop_all()
        for p in [*c.replicas.values(), *c.nodes.values()]:
            print(f"--- {p.name}\n{p.log_tail(30)}")
        kill_qemus_under(run)
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="module")
def store(cluster: LocalCluster) -> Iterator[Store]:
    s = Store(cluster.database_url, run_migrations=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def keys(store: Store) -> dict[str, str]:
    """Three tenants (made on the database, as `pal tenants create --database` does)."""
    return {name: store.create_tenant(name, 10)[1] for name in ("ta", "tb", "tc")}


def api(p: Proc, key: str) -> httpx.Client:
    return httpx.Client(base_url=p.url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def poll(what: str, fn: Any, timeout: float, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(every)


def sh(c: httpx.Client, vm: str, script: str) -> dict[str, Any]:
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", script]})
    assert r.status_code == 200, r.text
    return dict(r.json())


def slots_exact(store: Store, tenant_name: str) -> None:
    """Quota is exact: the slots held are the tenant's VMs in slot-holding states."""
    tenant = next(t for t in store.list_tenants() if t.name == tenant_name)
    live = [v for v in store.list_vms(tenant_id=tenant.id) if v.state in SLOT_STATES]
    assert store.count_slots(tenant.id) == len(live)
    assert all(v.holds_slot == (v.state in SLOT_STATES) for v in store.list_vms(tenant_id=tenant.id))


def delete_all(c: httpx.Client) -> None:
    for vm in c.get("/v1/runtime/vms").json()["vms"]:
        if vm["state"] != "terminated":
            c.delete(f"/v1/runtime/vms/{vm['vmId']}")


def test_twelve_vms_of_three_tenants_are_spread_by_the_placement_rules(
    cluster: LocalCluster, store: Store, keys: dict[str, str]
) -> None:
    """ta: 4 anywhere; tb: 3 anywhere + 1 in region us; tc: 4 on disk=ssd. Hard constraints
    first (tc -> n1, tb's us VM -> n3), then warm templates (the rest avoid n3, which has
    none), then fair share (each tenant's free VMs split between n1 and n2). Half of the
    requests go to the follower, which forwards them."""
    leader, follower = cluster.wait_leader(30), cluster.follower()
    specs = (
        [("ta", {})] * 4
        + [("tb", {})] * 3
        + [("tb", {"placement": {"region": "us"}})]
        + [("tc", {"placement": {"labels": {"disk": "ssd"}}})] * 4
    )

    def schedule(i: int, tenant: str, spec: dict[str, Any]) -> dict[str, Any]:
        with api(leader if i % 2 else follower, keys[tenant]) as c:
            r = c.post("/v1/runtime/schedule", json=spec)
            assert r.status_code == 200, r.text
            return dict(r.json(), tenant=tenant, spec=spec)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        vms = list(pool.map(lambda a: schedule(*a), [(i, t, s) for i, (t, s) in enumerate(specs)]))
    print(f"12 VMs scheduled in {time.monotonic() - t0:.1f} s")
    where = {v["vmId"]: store.get_vm(v["vmId"]).node_id for v in vms}  # type: ignore[union-attr]
    by: dict[tuple[str, bool], list[str | None]] = {}
    for v in vms:
        by.setdefault((v["tenant"], bool(v["spec"])), []).append(where[v["vmId"]])
    assert sorted(by[("tc", True)]) == ["n1"] * 4
    assert by[("tb", True)] == ["n3"]
    assert sorted(by[("ta", False)]) == ["n1", "n1", "n2", "n2"]
    assert sorted(by[("tb", False)]) in (["n1", "n1", "n2"], ["n1", "n2", "n2"])
    for v in vms:
        placed = [
            e["reason"]
            for e in api(follower, keys[v["tenant"]])
            .get(f"/v1/runtime/vms/{v['vmId']}/events")
            .json()["events"]
            if (e.get("reason") or "").startswith("placed on")
        ]
        assert placed and placed[0].startswith(f"placed on {where[v['vmId']]}: ")
    views = cluster.node_views()
    assert {n: views[n]["vmsPlaced"] for n in views} == {
        n: sum(1 for x in where.values() if x == n) for n in ("n1", "n2", "n3")
    }
    for tenant in keys:
        slots_exact(store, tenant)
        with api(follower, keys[tenant]) as c:
            delete_all(c)


def test_a_request_to_a_follower_works(cluster: LocalCluster, keys: dict[str, str]) -> None:
    follower = cluster.follower()
    with api(follower, keys["ta"]) as c:
        vm = c.post("/v1/runtime/schedule", json={}).json()["vmId"]  # forwarded
        assert c.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"  # served locally
        assert sh(c, vm, "echo hi")["stdout"] == "hi\n"  # forwarded
        with c.stream("POST", f"/v1/runtime/vms/{vm}/exec", headers={"Accept": "text/event-stream"},
                      json={"command": "/bin/sh", "argv": ["-c", "echo a; echo b"]}) as r:  # fmt: skip
            text = "".join(r.iter_text())
        assert "event: exit" in text and "a" in text
        r = c.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "x.txt"}, content=b"via follower")
        assert r.status_code == 200, r.text
        assert c.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "x.txt"}).text == "via follower"
    # The dashboard is served by every `pal server`; on the follower its actions reach the leader.
    for replica in cluster.replicas.values():
        page = httpx.get(replica.url + "/runtime", follow_redirects=True, timeout=60)
        assert page.status_code == 200 and 'name="api_key"' in page.text, replica.name
    with httpx.Client(base_url=follower.url, timeout=300) as browser:
        page = browser.get("/runtime/login")
        form = {"api_key": keys["ta"], "csrf": _csrf(page.text), "next": "/runtime"}
        assert browser.post("/runtime/login", data=form).status_code == 303
        listing = browser.get("/runtime")
        assert listing.status_code == 200 and vm in listing.text
        gone = browser.post(f"/runtime/{vm}/delete", headers={"X-CSRF-Token": _csrf(listing.text)})
        assert gone.status_code == 200 and "Deleted (terminated)" in gone.text, gone.text
    with api(follower, keys["ta"]) as c:
        assert c.get(f"/v1/runtime/vms/{vm}").json()["state"] == "terminated"
    r = cluster.admin("GET", "/v1/nodes", via=follower)
    assert r.status_code == 200 and len(r.json()["nodes"]) == 3


def test_a_follower_takes_forwarding_only_from_replicas(cluster: LocalCluster, keys: dict[str, str]) -> None:
    """Real replicas on PostgreSQL: a forged X-Pal-Forwarded is refused, an anonymous large
    body is refused before it is read, a name that is not the replica's gets 421, and loopback
    is not the operator."""
    follower = cluster.follower()
    with api(follower, keys["tb"]) as c:
        before = c.get("/v1/runtime/vms").json()["vms"]
        forged = c.post("/v1/runtime/schedule", json={}, headers={"X-Pal-Forwarded": "1"})
        assert forged.status_code == 403, forged.text
        assert c.get("/v1/runtime/vms").json()["vms"] == before  # nothing scheduled
        rebound = c.get("/v1/runtime/vms", headers={"Host": "evil.example"})
        assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "MISDIRECTED_REQUEST"
    host, port = follower.url.removeprefix("http://").split(":")
    head = (
        f"PUT /v1/runtime/vms/vm-x/files/content?path=a HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {1 << 20}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + b"x" * 4096)  # 4 KiB of the 1 MiB it declares
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    for replica in cluster.replicas.values():
        assert httpx.get(replica.url + "/metrics", timeout=60).status_code == 401, replica.name
        assert httpx.get(replica.url + "/v1/nodes", timeout=60).status_code == 401, replica.name


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, html
    return m.group(1)


def _fork_then_kill_the_leader(cluster: LocalCluster, store: Store, key: str, src: str, late: bool) -> float:
    """One round: returns the failover time."""
    leader = cluster.wait_leader(30)
    follower = cluster.follower()
    before = {v.vm_id for v in store.list_vms(parent_vm_id=src)}
    n2 = cluster.base / "n2"
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(lambda: api(leader, key).post(f"/v1/runtime/vms/{src}/fork", json={"count": 2}))

    def children() -> list[Any]:
        return [v for v in store.list_vms(parent_vm_id=src) if v.vm_id not in before]

    kids = poll("fork children exist", lambda: len(children()) == 2 and children(), 60, every=0.02)
    if late:  # later in the fork: a child's QEMU is starting
        poll(
            "a child QEMU starts",
            lambda: any(k.vm_id in qemus_by_vm(n2) for k in kids),
            60,
            every=0.02,
        )
    t_kill = time.monotonic()
    cluster.kill(leader)
    new = cluster.wait_leader(10, exclude=leader)
    failover = time.monotonic() - t_kill
    assert new is follower
    with contextlib.suppress(Exception):
        fut.result(timeout=60)  # the client saw the connection drop (or an answer)
    pool.shutdown()

    def settled() -> list[str] | None:
        states = [store.get_vm(k.vm_id).state for k in kids]  # type: ignore[union-attr]
        return states if all(s in ("running", "failed") for s in states) else None

    states = poll("the fork settles", settled, 60)
    assert states in (["running", "running"], ["failed", "failed"]), states
    if states == ["failed", "failed"]:
        # A dropped child's slot may already be gone: then its QEMU would show under its bare
        # slot name, which neither a VM row nor the node's warm pool has.
        def no_kid_qemu() -> bool:
            owners = set(qemus_by_vm(n2)) - set(pooled_vms(n2))
            return not any(k.vm_id in owners for k in kids) and all(store.get_vm(v) for v in owners)

        poll("no QEMU of a dropped child", no_kid_qemu, 60)
    slots_exact(store, "ta")
    restarted = cluster.restart(leader)  # back as a follower
    poll("the restarted replica answers", lambda: cluster.health(restarted), 60)
    with api(new, key) as c:
        for k in kids:
            c.delete(f"/v1/runtime/vms/{k.vm_id}")
    return failover


def test_kill_9_of_the_leader_during_a_fork_five_times(
    cluster: LocalCluster, store: Store, keys: dict[str, str]
) -> None:
    """Each time: a fork of 2 is in flight (its children exist; every other time their QEMUs
    are starting), the leader is killed -9; the other replica leads within 10 s, the fork ends
    all-or-nothing (no child of an uncommitted fork runs), quota stays exact."""
    with api(cluster.follower(), keys["ta"]) as c:
        src = c.post("/v1/runtime/schedule", json={"placement": {"labels": {"pool": "b"}}}).json()["vmId"]
    failovers = [_fork_then_kill_the_leader(cluster, store, keys["ta"], src, bool(i % 2)) for i in range(5)]
    print(f"failover after kill -9: {[round(x, 2) for x in failovers]} s")
    assert max(failovers) < 10
    with api(cluster.wait_leader(30), keys["ta"]) as c:
        assert sh(c, src, "echo still")["stdout"] == "still\n"
        c.delete(f"/v1/runtime/vms/{src}")
    slots_exact(store, "ta")


def _s3_has(cluster: LocalCluster, s3_endpoint: str, vm_id: str, snapshot_id: str) -> bool:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    with contextlib.suppress(Exception):
        keys = s3.list_objects_v2(Bucket=cluster.s3_bucket, Prefix="snapshots/").get("Contents", [])
        return any(f"/{vm_id}/{snapshot_id}/meta.json" in k["Key"] for k in keys)
    return False


def test_kill_9_of_a_node_fails_its_running_vms_and_its_paused_vm_resumes_elsewhere(
    cluster: LocalCluster, store: Store, keys: dict[str, str], s3_server: S3Server
) -> None:
    """On one node: a running VM and a paused one (files and a process inside). kill -9 of
    that node: the paused VM resumes at once on another node from S3 with its files and
    process; the running one is FAILED ("node lost") within 40 s and its slot released. The
    node restarts, re-registers, and the QEMU it still had for the lost VM is stopped."""
    leader = cluster.wait_leader(30)
    with api(leader, keys["tb"]) as c:
        moving = c.post("/v1/runtime/schedule", json={"placement": {"region": "eu"}}).json()["vmId"]
        home = store.get_vm(moving).node_id  # type: ignore[union-attr]
        same_node = {"n1": {"disk": "ssd"}, "n2": {"pool": "b"}}[home or ""]
        running = c.post("/v1/runtime/schedule", json={"placement": {"labels": same_node}}).json()["vmId"]
        assert store.get_vm(running).node_id == home  # type: ignore[union-attr]
        sh(
            c,
            moving,
            "echo kept > /workspace/kept.txt; nohup sleep 100000 >/dev/null 2>&1 & echo $! > /workspace/pid",
        )
        pid = sh(c, moving, "cat /workspace/pid")["stdout"].strip()
        snap = c.post(f"/v1/runtime/vms/{moving}/pause").json()["snapshotId"]
    poll("the pause snapshot reached S3", lambda: _s3_has(cluster, s3_server.endpoint, moving, snap), 120)
    n1 = cluster.nodes[home or ""]
    t_kill = time.monotonic()
    cluster.kill(n1)
    with api(cluster.follower(), keys["tb"]) as c:
        t0 = time.monotonic()
        r = c.post(f"/v1/runtime/vms/{moving}/resume")
        assert r.status_code == 200, r.text
        print(f"resume on another node after kill -9 of its node: {time.monotonic() - t0:.1f} s")
        assert store.get_vm(moving).node_id not in (home, None)  # type: ignore[union-attr]
        assert sh(c, moving, "cat /workspace/kept.txt")["stdout"] == "kept\n"
        assert sh(c, moving, f"kill -0 {pid} && echo alive")["stdout"] == "alive\n"

    def lost() -> bool:
        vm = store.get_vm(running)
        return vm is not None and vm.state == "failed"

    poll("the running VM of the dead node fails", lost, 40 - (time.monotonic() - t_kill), every=0.5)
    print(f"node loss noticed {time.monotonic() - t_kill:.1f} s after kill -9")
    vm = store.get_vm(running)
    assert vm is not None and vm.reason == "node lost" and not vm.holds_slot
    slots_exact(store, "tb")
    stray_dir = vm_dir_of(n1.data_dir, running)  # type: ignore[arg-type]
    stray = qemu_pids_under(stray_dir)
    assert stray, "kill -9 of the node leaves its QEMUs running"
    cluster.restart(n1)
    poll("the node is back", lambda: cluster.node_views()[n1.name]["state"] == "active", 120)
    poll("the lost VM's QEMU is stopped", lambda: not qemu_pids_under(stray_dir), 60)
    assert store.get_vm(running).state == "failed"  # type: ignore[union-attr]
    with api(leader, keys["tb"]) as c:
        delete_all(c)
    slots_exact(store, "tb")


def test_drain_pauses_a_nodes_vms_and_they_wake_elsewhere(
    cluster: LocalCluster, store: Store, keys: dict[str, str]
) -> None:
    with api(cluster.follower(), keys["tc"]) as c:
        vm = c.post("/v1/runtime/schedule", json={"placement": {"region": "eu"}}).json()["vmId"]
        home = store.get_vm(vm).node_id  # type: ignore[union-attr]
        sh(c, vm, "echo before-drain > /workspace/d.txt")
        # The operator's CLI, through the follower.
        env = {"PAL_URL": cluster.follower().url, "PAL_ADMIN_TOKEN": cluster.admin_token}
        try:
            drained = json.loads(pal_cli("node", "drain", str(home), env=env).stdout)
            assert drained["paused"] == [vm] and drained["failed"] == {}
            got = c.get(f"/v1/runtime/vms/{vm}").json()
            assert got["state"] == "paused" and "draining" in got["reason"]
            listed = {n["nodeId"]: n for n in json.loads(pal_cli("node", "ls", env=env).stdout)}
            assert listed[home]["state"] == "draining" and set(listed) == {"n1", "n2", "n3"}
            assert "draining" in pal_cli("node", "ls", "--table", env=env).stdout
            assert sh(c, vm, "cat /workspace/d.txt")["stdout"] == "before-drain\n"  # woken elsewhere
            assert store.get_vm(vm).node_id != home  # type: ignore[union-attr]
            assert json.loads(pal_cli("node", "activate", str(home), env=env).stdout)["state"] == "active"
            # --migrate: the VM's new node is drained, and the VM resumes at once on the other
            # node of its region (its old home, active again), through S3.
            there = str(store.get_vm(vm).node_id)  # type: ignore[union-attr]
            moved = json.loads(pal_cli("node", "drain", there, "--migrate", env=env).stdout)
            # Only this tenant's VM is asserted on: another test's VM that no other node can run
            # (a label only this node has) stays paused and is listed under "failed".
            assert moved["migrated"].get(vm) == home and vm not in moved["failed"], moved
            assert c.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"
            assert sh(c, vm, "cat /workspace/d.txt")["stdout"] == "before-drain\n"
            assert json.loads(pal_cli("node", "activate", there, env=env).stdout)["state"] == "active"
        finally:  # whatever failed above, the next test gets every node back
            for node in ("n1", "n2", "n3"):
                pal_cli("node", "activate", node, env=env, check=False)
        c.delete(f"/v1/runtime/vms/{vm}")
    slots_exact(store, "tc")


def test_a_process_paused_on_one_node_is_reattached_on_another(
    cluster: LocalCluster, store: Store, keys: dict[str, str], s3_server: S3Server
) -> None:
    """Issue 22: a process and its journal travel with the VM's snapshot. Started and read
    in part on one node; the VM paused, its node drained; resumed on the other node of its
    region, where the reader reattaches from its offset and the output is complete."""
    from tests.integration.test_processes import follow, procs, start

    script = "seq 1 3000; read x; echo got $x; seq 3001 6000"
    want = (
        "".join(f"{i}\n" for i in range(1, 3001)) + "got go\n" + "".join(f"{i}\n" for i in range(3001, 6001))
    )
    leader = cluster.wait_leader(30)
    with api(leader, keys["ta"]) as c:
        vm = c.post("/v1/runtime/schedule", json={"placement": {"region": "eu"}}).json()["vmId"]
        home = str(store.get_vm(vm).node_id)  # type: ignore[union-attr]
        pid = start(c, vm, script, stdin=True)
        first, offset, how, _ = follow(c, vm, pid, 0, stop_after=5000)
        assert how == "dropped"
        snap = c.post(f"/v1/runtime/vms/{vm}/pause").json()["snapshotId"]
    poll("the pause snapshot reached S3", lambda: _s3_has(cluster, s3_server.endpoint, vm, snap), 120)
    env = {"PAL_URL": cluster.follower().url, "PAL_ADMIN_TOKEN": cluster.admin_token}
    pal_cli("node", "drain", home, env=env)
    try:
        with api(cluster.follower(), keys["ta"]) as c:
            r = c.post(f"/v1/runtime/vms/{vm}/resume")
            assert r.status_code == 200, r.text
            assert store.get_vm(vm).node_id not in (home, None)  # type: ignore[union-attr]
            assert c.get(f"{procs(vm)}/{pid}").json()["running"] is True
            assert c.post(f"{procs(vm)}/{pid}/stdin", content=b"go\n").status_code == 200
            rest, end, how, body = follow(c, vm, pid, offset)
            assert how == "exit" and body["exitCode"] == 0, (how, body)
            assert (first + rest).decode() == want and end == len(want)
            c.delete(f"/v1/runtime/vms/{vm}")
    finally:
        pal_cli("node", "activate", home, env=env)
    slots_exact(store, "ta")


def test_a_lifetime_ends_after_a_failover(cluster: LocalCluster, store: Store, keys: dict[str, str]) -> None:
    """The deadline is in the store, not in the leader's memory: the leader that scheduled
    the VM is killed -9, the deadline passes (written an hour ahead, as if that hour went
    by during the failover), and the new leader ends the VM."""
    leader = cluster.wait_leader(30)
    with api(leader, keys["tc"]) as c:
        vm = c.post("/v1/runtime/schedule", json={"lifetimeSecs": 3600}).json()
        assert vm["state"] == "running" and vm["lifetimeSecs"] == 3600, vm
    cluster.kill(leader)
    new = cluster.wait_leader(10, exclude=leader)
    store.update_vm(vm["vmId"], lifetime_ends_at=datetime.now(UTC) - timedelta(seconds=1))
    with api(new, keys["tc"]) as c:

        def ended() -> list[dict[str, Any]]:  # the sweep writes its event once the delete is done
            events = c.get(f"/v1/runtime/vms/{vm['vmId']}/events").json()["events"]
            return [e for e in events if e["kind"] == "lifetime_ended"]

        poll("the lifetime ends", ended, 60)
        assert c.get(f"/v1/runtime/vms/{vm['vmId']}").json()["state"] == "terminated"
        assert [e["details"]["action"] for e in ended()] == ["deleted"]
    restarted = cluster.restart(leader)  # back as a follower
    poll("the restarted replica answers", lambda: cluster.health(restarted), 60)
    slots_exact(store, "tc")
