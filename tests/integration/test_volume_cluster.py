"""Issue 34, a resume on another node mounts the volume there (docs/volumes.md, "Volumes in a
cluster"): a local cluster of one control-plane replica and two nodes whose volumes live on
one PAL_VOLUMES_DIR (on one machine, a directory; in production a file system every node
mounts). A VM mounts a volume on one node and writes; it is paused, its node drained, and it
resumes on the other node, where it reads what it wrote, through a file it kept open too,
and writes more; a VM on the first node reads that. Boots two VMs (and restores one)."""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.store import Store
from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import LocalCluster, kill_qemus_under
from tests.conftest import TEST_DATA_DIR, PalServer, pal_cli
from tests.integration.test_cluster import _s3_has, api, poll, sh
from tests.integration.test_processes import procs, start, wait
from tests.s3server import S3Server

pytestmark = [pytest.mark.vm, pytest.mark.s3]

MNT = "/mnt/vol"


@pytest.fixture(scope="module")
def cluster(
    postgres: LocalPostgres, s3_server: S3Server, pal_server: PalServer, tenant_key: str
) -> Iterator[LocalCluster]:
    run = TEST_DATA_DIR / "runs" / f"v-{uuid.uuid4().hex[:6]}"  # short: unix socket paths < 108 bytes
    shared = run / "shared-volumes"  # what every node mounts at the same path
    shared.mkdir(parents=True)
    c = LocalCluster(
        base=run,
        database_url=postgres.new_database("volcluster"),
        shared_images=TEST_DATA_DIR,
        s3_endpoint=s3_server.endpoint,
        s3_bucket=f"pal-volc-{uuid.uuid4().hex[:6]}",
        extra_env={
            "PAL_IDLE_SWEEP_INTERVAL": "1",
            "PAL_HARNESS_READY_TIMEOUT_MS": "60000",
            "PAL_PRESTART": "0",
            "PAL_VOLUMES_DIR": str(shared),
        },
    )
    try:
        c.start_replica("r1")
        c.wait_leader(60)
        c.start_node("n1", region="eu", labels={"side": "n1"}, memory_mib=2560)
        c.start_node("n2", region="eu", labels={"side": "n2"}, memory_mib=2560)
        c.wait_nodes(["n1", "n2"], 300)
        yield c
    finally:
        c.stop_all()
        for p in [*c.replicas.values(), *c.nodes.values()]:
            print(f"--- {p.name}\n{p.log_tail(30)}")
        kill_qemus_under(run)
        shutil.rmtree(run, ignore_errors=True)


def ok(c: object, vm: str, script: str) -> str:
    out = sh(c, vm, script)  # type: ignore[arg-type]
    assert out["exitCode"] == 0, out
    return str(out["stdout"])


def test_a_volume_follows_its_vm_to_another_node(cluster: LocalCluster, s3_server: S3Server) -> None:
    store = Store(cluster.database_url, run_migrations=False)
    key = store.create_tenant("tv", 10)[1]
    leader = cluster.wait_leader(30)
    env = {"PAL_URL": leader.url, "PAL_ADMIN_TOKEN": cluster.admin_token}
    with api(leader, key) as c:
        r = c.post("/v1/volumes", json={"name": "work", "sizeMib": 64})
        assert r.status_code == 200, r.text
        mount = [{"name": "work", "path": MNT}]
        r = c.post("/v1/runtime/schedule", json={"placement": {"region": "eu"}, "volumes": mount})
        assert r.status_code == 200, r.text
        vm = r.json()["vmId"]
        home = str(store.get_vm(vm).node_id)  # type: ignore[union-attr]
        ok(c, vm, f"mkdir -p {MNT}/d && echo before-the-move > {MNT}/d/a.txt && sync")
        # A file held open across the move: its NFS handle must stay good on the other node.
        pid = start(c, vm, f"exec 7<{MNT}/d/a.txt; read x; cat <&7", stdin=True)
        snap = c.post(f"/v1/runtime/vms/{vm}/pause").json()["snapshotId"]
    poll("the pause snapshot reached S3", lambda: _s3_has(cluster, s3_server.endpoint, vm, snap), 120)
    pal_cli("node", "drain", home, env=env)
    try:
        with api(leader, key) as c:
            r = c.post(f"/v1/runtime/vms/{vm}/resume")
            assert r.status_code == 200, r.text
            there = str(store.get_vm(vm).node_id)  # type: ignore[union-attr]
            assert there not in (home, "None")
            assert ok(c, vm, f"cat {MNT}/d/a.txt").strip() == "before-the-move"
            stdin = c.post(f"{procs(vm)}/{pid}/stdin", content=b"go\n")
            assert stdin.status_code == 200, stdin.text
            done = wait(c, vm, pid)  # the descriptor opened on the first node reads on here
            assert done["exitCode"] == 0, done
            out = c.get(f"{procs(vm)}/{pid}/output").json()
            assert "before-the-move" in str(out), out
            ok(c, vm, f"echo after-the-move >> {MNT}/d/a.txt && echo new > {MNT}/d/b.txt && sync")
    finally:
        pal_cli("node", "activate", home, env=env)
    with api(leader, key) as c:
        r = c.post("/v1/runtime/schedule", json={"placement": {"labels": {"side": home}}, "volumes": mount})
        assert r.status_code == 200, r.text
        reader = r.json()["vmId"]
        assert str(store.get_vm(reader).node_id) == home  # type: ignore[union-attr]
        assert ok(c, reader, f"cat {MNT}/d/a.txt {MNT}/d/b.txt").split() == [
            "before-the-move",
            "after-the-move",
            "new",
        ]
        # Both nodes' servers exported it under its own Export_Id (the one in every handle).
        vid = c.get("/v1/volumes/work").json()["volumeId"]
        meta = json.loads((Path(cluster.extra_env["PAL_VOLUMES_DIR"]) / vid / "volume.json").read_text())
        for node in ("n1", "n2"):
            conf = (cluster.base / node / "run" / "volumes" / "ganesha.conf").read_text()
            ids = re.findall(r"Export_Id = (\d+);\n    Path = [^\n]*\n    Pseudo = /(vol-[^;]+);", conf)
            assert (str(meta["exportId"]), vid) in ids, (node, conf)
        # And the files API, answered by whichever node serves it, sees the same files.
        got = c.get("/v1/volumes/work/files/content", params={"path": "d/b.txt"})
        assert got.status_code == 200 and got.text.strip() == "new", got.text
        for v in (vm, reader):
            c.delete(f"/v1/runtime/vms/{v}")
        assert c.delete("/v1/volumes/work").status_code == 200
    store.close()
