"""scripts/cluster-demo.sh: a whole cluster on this machine, data dirs in a temp dir.

PostgreSQL (initdb/pg_ctl, 127.0.0.1), an S3 server (moto), 2 `pal server` replicas and 3
`pal node`s, a tenant, and one VM scheduled through the follower. Prints how to reach it
and waits for Ctrl-C (``--once``: tears down right after the tour). Everything it started
goes when it ends: processes, VMs, network namespaces, the temp dir (and its loop mount).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from pal.config import Settings
from pal.store import Store
from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import LocalCluster
from pal_tools.localcluster.s3 import TEST_ENV, S3Server


def say(msg: str) -> None:
    print(f"\033[1m==> {msg}\033[0m", flush=True)


def prepare(base: Path, images_from: Path) -> None:
    """``base`` on a reflink file system (a loop-mounted XFS image if /tmp cannot reflink),
    with a copy of a built image (built here if ``images_from`` has none)."""
    from pal.server import ensure_image, prepare_data_dir

    os.environ.setdefault("PAL_XFS_IMAGE_GIB", "16")
    shared = Settings.from_env(base)
    say(f"data dir {base}: {prepare_data_dir(shared)}")
    src = images_from / "images"
    if (src / "default" / "meta.json").exists():
        say(f"copying the built image from {src}")
        (base / "images").mkdir(exist_ok=True)
        for entry in src.iterdir():
            if entry.name != ".cache":  # the builder's download cache: not needed to run
                subprocess.run(["cp", "-a", "--reflink=auto", str(entry), str(base / "images")], check=True)
    say("guest image (built now if it was not there: a few minutes)")
    ensure_image(shared)


def teardown(base: Path) -> None:
    from pal.vmm.datadir import xfs_image_path

    if os.path.ismount(base):
        subprocess.run(["umount", str(base)], check=False)
        xfs_image_path(base).unlink(missing_ok=True)
    shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--once", action="store_true", help="tear down right after the tour")
    ap.add_argument("--images-from", type=Path, default=Path(os.environ.get("PAL_DATA_DIR", "/var/lib/pal")))
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pal-demo-"))
    os.environ.update(TEST_ENV)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        prepare(base, args.images_from)
        with LocalPostgres() as pg, S3Server() as s3:
            say(f"PostgreSQL on 127.0.0.1:{pg.port}, S3 (moto) on {s3.endpoint}")
            c = LocalCluster(
                base=base / "c", database_url=pg.url, shared_images=base, s3_endpoint=s3.endpoint
            )
            c.base.mkdir()
            try:
                for name in ("r1", "r2"):
                    c.start_replica(name)
                    c.wait_leader(60)
                c.start_node("n1", region="eu", labels={"disk": "ssd"})
                c.start_node("n2", region="eu")
                c.start_node("n3", region="us")
                say("waiting for the nodes to register")
                c.wait_nodes(["n1", "n2", "n3"], 900)
                key = Store(pg.url, run_migrations=False).create_tenant("demo", 10)[1]
                leader, follower = c.wait_leader(30), c.follower()
                say(f"leader {leader.url}, follower {follower.url}; scheduling a VM through the follower")
                h = {"Authorization": f"Bearer {key}"}
                vm = httpx.post(follower.url + "/v1/runtime/schedule", json={}, headers=h, timeout=600).json()
                out = httpx.post(follower.url + f"/v1/runtime/vms/{vm['vmId']}/exec", headers=h, timeout=600,
                                 json={"command": "/bin/uname", "argv": ["-a"]}).json()  # fmt: skip
                print(out.get("stdout", out), flush=True)
                for n in c.node_views().values():
                    print(f"  {n['nodeId']}: {n['state']}, region {n['region'] or '-'}, {n['vmsPlaced']} VMs")
                print(
                    f"\nexport PAL_URL={follower.url} PAL_API_KEY={key} PAL_ADMIN_TOKEN={c.admin_token}\n"
                    "pal vm ls; pal node ls --table; pal node drain n1\n"
                    f"logs: {c.base}/*.log\n",
                    flush=True,
                )
                if not args.once:
                    say("running; Ctrl-C stops everything")
                    while not stop["now"]:
                        time.sleep(0.5)
            except KeyboardInterrupt:
                pass
            finally:
                say("stopping")
                c.stop_all()
    finally:
        teardown(base)


if __name__ == "__main__":
    main()
