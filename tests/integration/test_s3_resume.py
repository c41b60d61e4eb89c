"""Issue: the S3 mirror through the product — a paused VM resumes from S3 when the local
snapshot is gone. Runs its own `pal up` against a real S3-compatible server (moto_server)."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator

import boto3
import pytest

from tests.conftest import TEST_DATA_DIR, PalServer, prepare_base_dir, start_server, stop_server
from tests.s3server import TEST_ENV, S3Server

pytestmark = [pytest.mark.vm, pytest.mark.s3]


@pytest.fixture
def s3_pal(s3_server: S3Server) -> Iterator[tuple[PalServer, str]]:
    prepare_base_dir()
    bucket = f"pal-it-{uuid.uuid4().hex[:8]}"
    run_dir = TEST_DATA_DIR / "runs" / f"s3-{uuid.uuid4().hex[:8]}"
    env = {"S3_ENDPOINT": s3_server.endpoint, "S3_BUCKET": bucket, **TEST_ENV}
    server = start_server(run_dir, extra_env=env)
    try:
        yield server, bucket
    finally:
        stop_server(server)
        shutil.rmtree(run_dir, ignore_errors=True)


def s3_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        out = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    except s3.exceptions.NoSuchBucket:
        return []
    return [o["Key"] for o in out.get("Contents", [])]


def test_resume_from_s3_after_the_local_copy_is_deleted(
    s3_pal: tuple[PalServer, str], s3_server: S3Server
) -> None:
    server, bucket = s3_pal
    key = server.tenant("s3-user", max_vms=2)
    with server.client(key) as c:
        vm = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
        try:
            c.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "notes.txt"}, content="in s3\n")
            c.post(
                f"/v1/runtime/vms/{vm}/exec",
                json={"command": "/bin/sh", "argv": ["-c", "echo 41 > /tmp/in-memory"]},
            )
            snap = c.post(f"/v1/runtime/vms/{vm}/pause").json()["snapshotId"]
            # The mirror uploads in the background, meta.json last: wait for it.
            deadline = time.time() + 120
            keys: list[str] = []
            while time.time() < deadline:
                keys = s3_keys(s3_server.endpoint, bucket, "snapshots/")
                if any(k.endswith(f"/{vm}/{snap}/meta.json") for k in keys):
                    break
                time.sleep(0.5)
            mine = [k for k in keys if f"/{vm}/{snap}/" in k]
            assert any(k.endswith("/meta.json") for k in mine), keys
            assert {k.rsplit("/", 1)[1] for k in mine} >= {"snapshot", "mem", "rootfs", "meta.json"}
            # Lose the local tier entirely.
            local = list(server.data_dir.glob(f"snapshots/*/{vm}"))
            assert local
            for d in local:
                shutil.rmtree(d)
            r = c.post(f"/v1/runtime/vms/{vm}/resume")
            assert r.status_code == 200, r.text
            assert r.json()["snapshotId"] == snap
            got = c.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "notes.txt"})
            assert got.text == "in s3\n"
            out = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "cat", "argv": ["/tmp/in-memory"]})
            assert out.json()["stdout"] == "41\n", "memory state came back from S3 too"
        finally:
            c.delete(f"/v1/runtime/vms/{vm}")


def test_s3_outage_never_fails_a_pause(s3_server: S3Server) -> None:
    prepare_base_dir()
    run_dir = TEST_DATA_DIR / "runs" / f"s3down-{uuid.uuid4().hex[:8]}"
    dead = S3Server()  # a port nobody listens on
    env = {"S3_ENDPOINT": dead.endpoint, "S3_BUCKET": "pal-down", **TEST_ENV}
    server = start_server(run_dir, extra_env=env)
    try:
        key = server.tenant("s3-down", max_vms=1)
        with server.client(key) as c:
            vm = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
            r = c.post(f"/v1/runtime/vms/{vm}/pause")
            assert r.status_code == 200, r.text  # with no S3 reachable at all
            assert c.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
            c.delete(f"/v1/runtime/vms/{vm}")
    finally:
        stop_server(server)
        shutil.rmtree(run_dir, ignore_errors=True)
