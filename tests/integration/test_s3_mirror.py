"""The S3 mirror against a real S3-compatible server (moto_server subprocess)."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pal.errors import BackendError, NotFound
from pal.snapshots import store as store_module
from pal.snapshots.hashing import sparse_sha256
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.s3 import CorruptLocalCopy, S3Mirror
from pal.snapshots.store import SnapshotStore
from tests.s3server import TEST_ENV, S3Server, free_port

pytestmark = pytest.mark.s3

AV = "default-0123456789ab"
KEY = b"k" * 32  # the snapshot HMAC key (a cluster shares one)


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
    s = SnapshotStore(tmp_path / "snapshots", mirror_for(s3_server.endpoint, bucket), key=KEY)
    yield s
    s.close()


def take(store: SnapshotStore, ref: SnapshotRef) -> tuple[Path, dict[str, bytes]]:
    staging = store.staging_dir(ref.snapshot_id)
    (staging / "snapshot").write_bytes(os.urandom(8192))
    (staging / "vmm.json").write_text('{"memoryKind": "file"}')
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
    return path, {name: (path / name).read_bytes() for name in ("snapshot", "mem", "rootfs", "vmm.json")}


def test_locate_restores_from_s3_after_the_local_copy_is_lost(store: SnapshotStore) -> None:
    assert store.mirror is not None
    ref = SnapshotRef(AV, "vm-1", "snap-1", "tenant-a")
    path, contents = take(store, ref)
    assert store.flush(60)
    shutil.rmtree(path)  # the node lost its disk
    assert not store.exists(ref)

    located = store.locate(ref)
    assert located == path and store.verify(ref)
    for name, data in contents.items():
        assert (located / name).read_bytes() == data
    # holes survive the round trip: the 64 MiB disk holds 1 MiB of data
    assert os.stat(located / "rootfs").st_blocks * 512 < 8 << 20
    # and another tenant still cannot have it
    shutil.rmtree(path)
    with pytest.raises(NotFound):
        store.locate(SnapshotRef(AV, "vm-1", "snap-1", "tenant-b"))
    assert not path.exists()


def test_an_s3_copy_without_meta_is_not_a_snapshot(store: SnapshotStore) -> None:
    assert store.mirror is not None
    ref = SnapshotRef(AV, "vm-1", "partial", "t")
    path, _ = take(store, ref)
    assert store.flush(60)
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
    assert store.flush(60)
    assert store.mirror.read_meta(ref) is None
    assert store.mirror._list_keys(ref.s3_prefix) == []
    with pytest.raises(NotFound):
        store.locate(ref)


def test_delete_vm_removes_its_snapshots_from_both_tiers_but_the_kept(store: SnapshotStore) -> None:
    assert store.mirror is not None
    refs = [SnapshotRef(AV, "vm-d", sid, "t") for sid in ("a", "b")]
    for ref in refs:
        take(store, ref)
    assert store.flush(60) and (AV, "vm-d") in store.mirror.list_vms()
    store.delete_vm(AV, "vm-d", keep={"b"})
    assert store.flush(60)
    assert store.mirror._list_keys(refs[0].s3_prefix) == [] and store.mirror.read_meta(refs[1]) is not None
    store.delete_vm(AV, "vm-d")
    assert store.flush(60) and (AV, "vm-d") not in store.vms()


def test_retention_applies_to_the_s3_tier(tmp_path: Path, s3_server: S3Server, bucket: str) -> None:
    ticks = itertools.count()
    store = SnapshotStore(
        tmp_path / "snapshots",
        mirror_for(s3_server.endpoint, bucket),
        key=KEY,
        protected_provider=lambda av, vm: {"s0"},
        clock=lambda: time.time() + next(ticks),  # a second apart: distinct createdAt, no sleep
    )
    try:
        assert store.mirror is not None
        for i in range(5):
            take(store, SnapshotRef(AV, "vm-1", f"s{i}", "t"))
        assert store.flush(60)
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
    store = SnapshotStore(tmp_path / "snapshots", mirror_for(f"http://127.0.0.1:{port}", bucket), key=KEY)
    try:
        assert store.mirror is not None
        ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
        path, contents = take(store, ref)  # succeeds although S3 refuses connections
        assert store.verify(ref) and store.flush_seals(30)
        assert not store.mirror.flush(2)  # still failing, still queued
        assert store.mirror.pending() == 1
        with S3Server(port):
            assert store.flush(60)
            shutil.rmtree(path)
            assert store.locate(ref) == path
            assert (path / "mem").read_bytes() == contents["mem"]
    finally:
        store.close()


def test_commit_does_not_wait_for_a_server_that_hangs(tmp_path: Path, bucket: str) -> None:
    # Accepts connections (kernel backlog) but never answers, and the client waits an hour
    # for an answer: a commit that uploaded synchronously could not return while it hangs.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        mirror = S3Mirror(endpoint, bucket, "us-east-1", connect_timeout_s=3600, read_timeout_s=3600)
        store = SnapshotStore(tmp_path / "snapshots", mirror, key=KEY)
        try:
            assert store.mirror is not None
            ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
            committing = threading.Thread(target=take, args=(store, ref))
            committing.start()
            committing.join(300)  # a hang guard, far below the client's hour
            assert not committing.is_alive(), "the commit waited for the hung S3 server"
            assert store.verify(ref) and store.flush_seals(30)
            assert store.mirror.pending() == 1
        finally:
            hung.close()  # resets the queued connections: the uploader stops waiting
            store.close()


def test_pending_uploads_survive_a_restart(tmp_path: Path, bucket: str) -> None:
    port = free_port()
    root = tmp_path / "snapshots"
    first = SnapshotStore(root, mirror_for(f"http://127.0.0.1:{port}", bucket), key=KEY)
    ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
    try:
        take(first, ref)
    finally:
        first.close()  # the manager stops before the upload ever succeeded

    with S3Server(port):
        second = SnapshotStore(root, mirror_for(f"http://127.0.0.1:{port}", bucket), key=KEY)
        try:
            assert second.mirror is not None
            assert second.mirror.pending() == 1
            assert second.mirror.flush(60)
            meta = second.mirror.read_meta(ref)
            assert meta is not None and meta["tenantId"] == "t"
        finally:
            second.close()


# -- sealing and sparse objects -------------------------------------------------------

MiB = 1 << 20


class SealGate:
    """Holds the background seal worker before it hashes (until ``release`` is set), or
    makes it fail (``fail``), while seal_now in the test's thread works normally."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.fail = False
        real = store_module.hash_files

        def gated(paths: Any, *, fsync: bool = False) -> Any:
            if threading.current_thread().name == "pal-seal":
                if self.fail:
                    raise OSError(5, "simulated I/O error while sealing")
                assert self.release.wait(60)
            return real(paths, fsync=fsync)

        monkeypatch.setattr(store_module, "hash_files", gated)


@pytest.fixture
def seal_gate(store: SnapshotStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[SealGate]:
    gate = SealGate(monkeypatch)
    yield gate
    gate.release.set()  # before the store's teardown drains its seals


def take_big(store: SnapshotStore, ref: SnapshotRef) -> tuple[Path, dict[str, dict[int, bytes]]]:
    """A 256 MiB mem and a 2 GiB disk holding a few MiB of data at scattered offsets."""
    staging = store.staging_dir(ref.snapshot_id)
    (staging / "snapshot").write_bytes(os.urandom(8192))
    (staging / "vmm.json").write_text('{"memoryKind": "file"}')
    layout = {
        "mem": (256 * MiB, {0: os.urandom(MiB), 100 * MiB + 5: os.urandom(2 * MiB), 256 * MiB - 10: b"tail"}),
        "rootfs": (2048 * MiB, {3 * MiB: os.urandom(MiB), 1500 * MiB + 77: os.urandom(3 * MiB)}),
    }
    for name, (size, chunks) in layout.items():
        with open(staging / name, "wb") as f:
            f.truncate(size)
            for off, data in chunks.items():
                f.seek(off)
                f.write(data)
    path = store.commit(staging, ref, {"qemuVersion": "7.2.22"})
    return path, {name: chunks for name, (_, chunks) in layout.items()}


def test_only_sealed_snapshots_are_uploaded(store: SnapshotStore, seal_gate: SealGate) -> None:
    assert store.mirror is not None
    ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
    take(store, ref)
    assert store.mirror.flush(5)  # the mirror has nothing to do yet
    store.mirror.ensure_bucket()
    assert store.mirror._list_keys(ref.s3_prefix) == []

    seal_gate.release.set()
    assert store.flush(60)
    meta = store.mirror.read_meta(ref)
    assert meta is not None and meta["sealed"] is True
    assert set(meta["sha256"]) == {"snapshot", "mem", "rootfs", "vmm.json"}


def test_sparse_objects_upload_the_data_not_the_holes_and_round_trip(store: SnapshotStore) -> None:
    assert store.mirror is not None
    ref = SnapshotRef(AV, "vm-1", "big", "t")
    path, chunks = take_big(store, ref)
    assert store.flush(120)
    digests = {name: sparse_sha256(path / name) for name in ("mem", "rootfs")}

    # ~7 MiB of data (in 1 MiB blocks: at most 11 MiB) for 2.25 GiB of apparent size
    assert store.mirror.last_upload["bytes"] < 12 * MiB
    client, bucket = store.mirror._client, store.mirror.bucket
    head = client.head_object(Bucket=bucket, Key=ref.s3_key("rootfs"))
    assert head["ContentLength"] < 6 * MiB and head["Metadata"] == {"pal-encoding": "pal-sparse-v1"}
    assert client.head_object(Bucket=bucket, Key=ref.s3_key("vmm.json"))["Metadata"] == {}

    shutil.rmtree(path)
    assert store.locate(ref) == path and store.verify(ref)
    for name, written in chunks.items():
        assert sparse_sha256(path / name) == digests[name]
        with open(path / name, "rb") as f:
            for off, data in written.items():
                f.seek(off)
                assert f.read(len(data)) == data
    assert os.stat(path / "rootfs").st_size == 2048 * MiB
    assert os.stat(path / "rootfs").st_blocks * 512 < 16 * MiB  # holes stayed holes


def _tamper(store: SnapshotStore, ref: SnapshotRef, name: str, edit: Any) -> None:
    assert store.mirror is not None
    client, bucket = store.mirror._client, store.mirror.bucket
    obj = client.get_object(Bucket=bucket, Key=ref.s3_key(name))
    body = edit(bytearray(obj["Body"].read()))
    client.put_object(Bucket=bucket, Key=ref.s3_key(name), Body=bytes(body), Metadata=obj["Metadata"])


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], id="flipped-data-byte"),
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b[:8] + (1 << 30).to_bytes(8, "little") + b[16:], id="wrong-size"),
    ],
)
def test_a_damaged_s3_object_is_detected_on_download(store: SnapshotStore, edit: Any) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
    path, _ = take(store, ref)
    assert store.flush(60)
    _tamper(store, ref, "mem", edit)
    shutil.rmtree(path)
    with pytest.raises(BackendError):
        store.locate(ref)
    assert not path.exists()
    assert list((store.root / ".staging").iterdir()) == []


def test_a_local_copy_damaged_after_its_seal_is_not_mirrored(
    store: SnapshotStore, seal_gate: SealGate
) -> None:
    assert store.mirror is not None
    seal_gate.fail = True  # the worker (which queues the upload) cannot go ahead of us
    ref = SnapshotRef(AV, "vm-1", "snap-1", "t")
    path, _ = take(store, ref)
    store.seal_now(ref)
    with open(path / "rootfs", "r+b") as f:
        f.seek(40 * MiB + 3)
        f.write(b"\x00\x01")
    with pytest.raises(CorruptLocalCopy):
        store.mirror.upload(ref, path)
    seal_gate.fail = False
    assert store.flush(60)  # the queued upload gave up too
    assert store.mirror.read_meta(ref) is None
