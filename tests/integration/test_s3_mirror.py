"""The S3 mirror against a real S3-compatible server (moto_server subprocess)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.errors import NotFound
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.s3 import S3Mirror
from pal.snapshots.store import SnapshotStore
from tests.s3server import TEST_ENV, S3Server, free_port, s3_server

pytestmark = pytest.mark.s3
__all__ = ["s3_server"]  # the session fixture, re-exported for pytest

AV = "default-0123456789ab"


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TEST_ENV.items():
        monkeypatch.setenv(key, value)


def mirror_for(endpoint: str, bucket: str) -> S3Mirror:
    # fast retries so "the server came back" is seen within a test's patience
    return S3Mirror(
        endpoint,
        bucket,
        "us-east-1",
        retry_base_s=0.2,
        retry_max_s=1.0,
        connect_timeout_s=1.0,
        read_timeout_s=3.0,
    )


@pytest.fixture
def bucket(request: pytest.FixtureRequest) -> str:
    return "pal-" + request.node.name.replace("_", "-")[:40].lower()


@pytest.fixture
def store(tmp_path: Path, s3_server: S3Server, bucket: str) -> Iterator[SnapshotStore]:
    s = SnapshotStore(tmp_path / "snapshots", mirror_for(s3_server.endpoint, bucket))
    yield s
    s.close()


def take(store: SnapshotStore, ref: SnapshotRef) -> tuple[Path, dict[str, bytes]]:
    staging = store.staging_dir(ref.snapshot_id)
    (staging / "snapshot").write_bytes(os.urandom(8192))
    data = os.urandom(1 << 20)
    with open(staging / "mem", "wb") as f:
        f.truncate(16 << 20)
        f.seek(8 << 20)
        f.write(data)
    with open(staging / "rootfs", "wb") as f:
        f.truncate(64 << 20)
        f.seek(40 << 20)
        f.write(data)
    path = store.commit(staging, ref, {"qemuVersion": "7.2.22"})
    return path, {name: (path / name).read_bytes() for name in ("snapshot", "mem", "rootfs")}


def test_locate_restores_from_s3_after_the_local_copy_is_lost(store: SnapshotStore) -> None:
    assert store.mirror is not None
    ref = SnapshotRef(AV, "vm-1", "snap-1", "tenant-a")
    path, contents = take(store, ref)
    assert store.mirror.flush(60)
    shutil.rmtree(path)  # the node lost its disk
    assert not store.exists(ref)

    started = time.monotonic()
    located = store.locate(ref)
    elapsed = time.monotonic() - started
    assert located == path and store.verify(ref)
    for name, data in contents.items():
        assert (located / name).read_bytes() == data
    # holes survive the round trip: the 64 MiB disk holds 1 MiB of data
    assert os.stat(located / "rootfs").st_blocks * 512 < 8 << 20
    assert elapsed < 30
    # and another tenant still cannot have it
    shutil.rmtree(path)
    with pytest.raises(NotFound):
        store.locate(SnapshotRef(AV, "vm-1", "snap-1", "tenant-b"))
    assert not path.exists()


def test_an_s3_copy_without_meta_is_not_a_snapshot(store: SnapshotStore) -> None:
    assert store.mirror is not None
    ref = SnapshotRef(AV, "vm-1", "partial", "t")
    path, _ = take(store, ref)
    assert store.mirror.flush(60)
    store.mirror._client.delete_object(Bucket=store.mirror.bucket, Key=ref.s3_key("meta.json"))
    shutil.rmtree(path)
    with pytest.raises(NotFound):
        store.locate(ref)
    assert store.mirror.list_vm(AV, "vm-1") == []


def test_delete_removes_both_tiers(store: SnapshotStore) -> None:
    assert store.mirror is not None
    ref = SnapshotRef(AV, "vm-1", "gone", "t")
    take(store, ref)
    store.delete(ref)
    assert store.mirror.flush(60)
    assert store.mirror.read_meta(ref) is None
    assert store.mirror._list_keys(ref.s3_prefix) == []
    with pytest.raises(NotFound):
        store.locate(ref)


def test_retention_applies_to_the_s3_tier(tmp_path: Path, s3_server: S3Server, bucket: str) -> None:
    store = SnapshotStore(
        tmp_path / "snapshots",
        mirror_for(s3_server.endpoint, bucket),
        protected_provider=lambda av, vm: {"s0"},
    )
    try:
        assert store.mirror is not None
        for i in range(5):
            take(store, SnapshotRef(AV, "vm-1", f"s{i}", "t"))
            time.sleep(0.01)  # distinct createdAt
        assert store.mirror.flush(60)
        on_s3 = sorted(m["snapshotId"] for m in store.mirror.list_vm(AV, "vm-1"))
        # newest 3 plus the protected s0; s1 never reached S3 or was deleted there
        assert on_s3 == ["s0", "s2", "s3", "s4"]
        assert sorted(m["snapshotId"] for m in store.list_vm(AV, "vm-1")) == on_s3
    finally:
        store.close()


def test_upload_failure_does_not_fail_commit_and_is_retried_when_the_server_is_back(
    tmp_path: Path, bucket: str
) -> None:
    port = free_port()  # nothing listens here yet
    store = SnapshotStore(tmp_path / "snapshots", mirror_for(f"http://127.0.0.1:{port}", bucket))
    try:
        assert store.mirror is not None
        ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
        started = time.monotonic()
        path, contents = take(store, ref)
        assert time.monotonic() - started < 5  # commit never waits for S3
        assert store.verify(ref)
        assert not store.mirror.flush(2)  # still failing, still queued
        assert store.mirror.pending() == 1
        with S3Server(port):
            assert store.mirror.flush(60)
            shutil.rmtree(path)
            assert store.locate(ref) == path
            assert (path / "mem").read_bytes() == contents["mem"]
    finally:
        store.close()


def test_commit_does_not_wait_for_a_server_that_hangs(tmp_path: Path, bucket: str) -> None:
    # accepts connections (kernel backlog) but never answers: a synchronous upload
    # would block the commit for the read timeout and its retries
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        mirror = S3Mirror(endpoint, bucket, "us-east-1", connect_timeout_s=1.0, read_timeout_s=1.0)
        store = SnapshotStore(tmp_path / "snapshots", mirror)
        try:
            assert store.mirror is not None
            ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
            started = time.monotonic()
            take(store, ref)
            assert time.monotonic() - started < 2
            assert store.verify(ref) and store.mirror.pending() == 1
        finally:
            store.close()


def test_pending_uploads_survive_a_restart(tmp_path: Path, bucket: str) -> None:
    port = free_port()
    root = tmp_path / "snapshots"
    first = SnapshotStore(root, mirror_for(f"http://127.0.0.1:{port}", bucket))
    ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
    try:
        take(first, ref)
    finally:
        first.close()  # the manager stops before the upload ever succeeded

    with S3Server(port):
        second = SnapshotStore(root, mirror_for(f"http://127.0.0.1:{port}", bucket))
        try:
            assert second.mirror is not None
            assert second.mirror.pending() == 1
            assert second.mirror.flush(60)
            meta = second.mirror.read_meta(ref)
            assert meta is not None and meta["tenantId"] == "t"
        finally:
            second.close()
