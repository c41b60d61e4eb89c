"""The local snapshot store: atomic commit, verification, ownership, retention."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pal.config import Settings
from pal.errors import BackendError, Conflict, InvalidRequest, NotFound
from pal.snapshots import store as store_module
from pal.snapshots import store_reads
from pal.snapshots.jobqueue import JobQueue
from pal.snapshots.layout import META_FILE, SnapshotRef
from pal.snapshots.local import LocalTier, read_meta_file
from pal.snapshots.store import SnapshotStore

AV = "default-0123456789ab"
KEY = b"k" * 32  # the snapshot HMAC key (a cluster shares one)
DAY = 24 * 3600.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def write_artifacts(staging: Path, *, mem: bool = True, rootfs: bool = True) -> dict[str, bytes]:
    """Device state, a sparse 32 MiB mem and a sparse 64 MiB disk, like a small VM's."""
    written = {"snapshot": os.urandom(4096), "vmm.json": b'{"memoryKind": "file"}'}
    (staging / "snapshot").write_bytes(written["snapshot"])
    (staging / "vmm.json").write_bytes(written["vmm.json"])
    for name, size, present in (("mem", 32 << 20, mem), ("rootfs", 64 << 20, rootfs)):
        if not present:
            continue
        data = os.urandom(300_000)
        with open(staging / name, "wb") as f:
            f.truncate(size)
            f.seek(size // 3)
            f.write(data)
        written[name] = data
    return written


def take(store: SnapshotStore, ref: SnapshotRef, *, sealed: bool = True, **meta: object) -> Path:
    staging = store.staging_dir(ref.snapshot_id)
    write_artifacts(staging)
    path = store.commit(staging, ref, {"qemuVersion": "7.2.22", "kernelVersion": "6.1.0-28", **meta})
    if sealed:
        assert store.wait_sealed(ref, 30)
    return path


class SealGate:
    """Controls the background seal worker: hold it (it waits before hashing) or make it
    fail, while commit and seal_now (other threads) hash normally."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.fail = False
        self.entered = threading.Event()
        real = store_module.hash_files

        def gated(paths: Any, *, fsync: bool = False) -> Any:
            if threading.current_thread().name == "pal-seal":
                self.entered.set()
                if self.fail:
                    raise OSError(5, "simulated I/O error while sealing")
                assert self.open.wait(30)
            return real(paths, fsync=fsync)

        monkeypatch.setattr(store_module, "hash_files", gated)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[SnapshotStore]:
    s = SnapshotStore(tmp_path / "snapshots", None, key=KEY, clock=clock)
    yield s
    s.close()


def test_commit_publishes_a_complete_verified_snapshot(store: SnapshotStore) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-1", "tenant-a")
    staging = store.staging_dir("snap-1")
    written = write_artifacts(staging)
    path = store.commit(staging, ref, {"parentSnapshotId": "snap-0", "qemuVersion": "7.2.22"})
    assert store.wait_sealed(ref, 30)

    assert path == store.root / AV / "vm-1" / "snap-1"
    assert not staging.exists()
    assert sorted(p.name for p in path.iterdir()) == ["mem", "meta.json", "rootfs", "snapshot", "vmm.json"]
    assert (path / "snapshot").read_bytes() == written["snapshot"]
    assert store.exists(ref) and store.verify(ref) and store.verify(path)
    assert store.locate(ref) == path
    meta = store.read_meta(ref)
    assert meta["tenantId"] == "tenant-a" and meta["vmId"] == "vm-1"
    assert meta["parentSnapshotId"] == "snap-0" and meta["qemuVersion"] == "7.2.22"
    assert meta["hashAlgo"] == "sha256-sparse-v1"
    assert meta["sizes"] == {"snapshot": 4096, "mem": 32 << 20, "rootfs": 64 << 20, "vmm.json": 22}
    assert set(meta["sha256"]) == {"snapshot", "mem", "rootfs", "vmm.json"} and meta["sealed"] is True
    assert meta["createdAt"] == "2027-01-15T08:00:00Z"
    # sparse artifacts stay sparse (the store never rewrites them)
    assert os.stat(path / "rootfs").st_blocks * 512 < 8 << 20


def test_mem_and_rootfs_are_optional_but_device_state_is_not(store: SnapshotStore) -> None:
    staging = store.staging_dir("s-legacy")
    write_artifacts(staging, mem=False, rootfs=False)
    path = store.commit(staging, SnapshotRef(AV, "vm-1", "s-legacy", "t"), {"memory": "stream"})
    # only small artifacts: sealed by commit itself, nothing queued
    assert read_meta_file(path)["sealed"] is True and store.pending_seals() == 0  # type: ignore[index]
    assert store.verify(path)
    assert store.read_meta(SnapshotRef(AV, "vm-1", "s-legacy"))["sizes"].keys() == {"snapshot", "vmm.json"}

    empty = store.staging_dir("s-empty")
    (empty / "mem").write_bytes(b"x")
    with pytest.raises(InvalidRequest):
        store.commit(empty, SnapshotRef(AV, "vm-1", "s-empty", "t"), {})


def test_commit_refuses_stray_files_foreign_dirs_and_duplicate_ids(
    store: SnapshotStore, tmp_path: Path
) -> None:
    stray = store.staging_dir("s1")
    write_artifacts(stray)
    (stray / "qemu.log").write_text("oops")
    with pytest.raises(InvalidRequest):
        store.commit(stray, SnapshotRef(AV, "vm-1", "s1", "t"), {})

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_artifacts(elsewhere)
    with pytest.raises(InvalidRequest):
        store.commit(elsewhere, SnapshotRef(AV, "vm-1", "s1", "t"), {})

    take(store, SnapshotRef(AV, "vm-1", "s2", "t"))
    with pytest.raises(Conflict):
        take(store, SnapshotRef(AV, "vm-1", "s2", "t"))


def test_crash_before_rename_leaves_no_visible_snapshot(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-crash", "t")
    staging = store.staging_dir(ref.snapshot_id)
    write_artifacts(staging)

    def power_cut(self: LocalTier, staging: Path, ref: SnapshotRef) -> Path:
        raise SystemExit("simulated crash between meta.json and rename")

    monkeypatch.setattr(LocalTier, "publish", power_cut)
    with pytest.raises(SystemExit):
        store.commit(staging, ref, {})
    monkeypatch.undo()

    # the staging dir is complete (it even has meta.json) but is not a snapshot
    assert (staging / META_FILE).exists()
    assert not store.exists(ref)
    assert store.list_vm(AV, "vm-1") == []
    with pytest.raises(NotFound):
        store.locate(ref)
    # a restarted manager clears it, and the seal job of the never-published snapshot
    # drops itself
    store.close(drain_seals=False)
    restarted = SnapshotStore(store.root, None, key=KEY)
    try:
        assert restarted.cleanup_staging() == [staging.name]
        assert not staging.exists()
        assert restarted.flush(10) and restarted.pending_seals() == 0
        assert not ref.local_dir(store.root).exists()
    finally:
        restarted.close()


def test_a_directory_without_meta_is_not_a_snapshot(store: SnapshotStore) -> None:
    ref = SnapshotRef(AV, "vm-1", "half", "t")
    half = ref.local_dir(store.root)
    half.mkdir(parents=True)
    write_artifacts(half)
    assert not store.exists(ref)
    assert not store.verify(ref)
    assert store.list_vm(AV, "vm-1") == []
    with pytest.raises(NotFound):
        store.locate(ref)


@pytest.mark.parametrize("artifact", ["snapshot", "mem", "rootfs", "vmm.json"])
def test_verify_catches_a_flipped_byte(store: SnapshotStore, artifact: str) -> None:
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref)
    target = path / artifact
    with open(target, "r+b") as f:
        offset = {"snapshot": 100, "vmm.json": 5}.get(artifact, os.stat(target).st_size // 3 + 5)
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    assert not store.verify(ref)


def test_verify_catches_truncation_and_a_missing_artifact(store: SnapshotStore) -> None:
    a = take(store, SnapshotRef(AV, "vm-1", "s1", "t"))
    os.truncate(a / "rootfs", (64 << 20) - 4096)
    assert not store.verify(a)
    b = take(store, SnapshotRef(AV, "vm-1", "s2", "t"))
    (b / "mem").unlink()
    assert not store.verify(b)


def test_another_tenants_snapshot_is_not_found(store: SnapshotStore) -> None:
    take(store, SnapshotRef(AV, "vm-1", "s1", "tenant-a"))
    theirs = SnapshotRef(AV, "vm-1", "s1", "tenant-b")
    assert not store.exists(theirs)
    assert not store.verify(theirs)
    for call in (store.locate, store.read_meta, store.delete):
        with pytest.raises(NotFound):
            call(theirs)
    assert store.owner(theirs) == "tenant-a"
    assert store.exists(SnapshotRef(AV, "vm-1", "s1", "tenant-a"))
    assert store.list_vm(AV, "vm-1", tenant_id="tenant-b") == []


def test_delete_is_idempotent(store: SnapshotStore) -> None:
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    take(store, ref)
    store.delete(ref)
    assert not ref.local_dir(store.root).exists()
    store.delete(ref)
    with pytest.raises(NotFound):
        store.locate(ref)


def test_deleting_a_vms_last_snapshot_leaves_no_empty_dir(store: SnapshotStore) -> None:
    """A fork's snapshot goes one by one, after its last child: the VM's dir goes with
    the last of them (a churn of forks would otherwise pile up empty dirs)."""
    a, b = SnapshotRef(AV, "vm-1", "s1", "t"), SnapshotRef(AV, "vm-1", "s2", "t")
    take(store, a)
    take(store, b)
    store.delete(a)
    assert store.vms() == {(AV, "vm-1")}
    store.delete(b)
    assert store.vms() == set() and not b.local_dir(store.root).parent.exists()


_opened: list[SnapshotStore] = []


def request_close(store: SnapshotStore) -> None:
    _opened.append(store)


@pytest.fixture(autouse=True)
def _close_opened() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def test_commit_runs_retention_keeping_protected_snapshots(tmp_path: Path, clock: FakeClock) -> None:
    protected: set[str] = {"s0"}  # e.g. what a live fork still maps
    store = SnapshotStore(
        tmp_path / "snapshots", None, key=KEY, clock=clock, protected_provider=lambda av, vm: protected
    )
    request_close(store)
    for i in range(6):
        clock.now += 60
        take(store, SnapshotRef(AV, "vm-1", f"s{i}", "t"))
    take(store, SnapshotRef(AV, "vm-2", "other", "t"))  # another VM: its own budget
    assert [m["snapshotId"] for m in store.list_vm(AV, "vm-1")] == ["s0", "s3", "s4", "s5"]
    assert [m["snapshotId"] for m in store.list_vm(AV, "vm-2")] == ["other"]

    # eight days later, only the protected one and the newest (just written) remain
    clock.now += 8 * DAY
    take(store, SnapshotRef(AV, "vm-1", "s6", "t"))
    assert [m["snapshotId"] for m in store.list_vm(AV, "vm-1")] == ["s0", "s6"]

    protected.clear()
    assert store.apply_retention(AV, "vm-1", set()) == ["s0"]
    assert [m["snapshotId"] for m in store.list_vm(AV, "vm-1")] == ["s6"]


def test_without_a_protection_hook_commit_deletes_nothing(store: SnapshotStore, clock: FakeClock) -> None:
    for i in range(5):
        clock.now += 1
        take(store, SnapshotRef(AV, "vm-1", f"s{i}", "t"))
    assert len(store.list_vm(AV, "vm-1")) == 5
    assert store.apply_retention(AV, "vm-1", {"s0"}) == ["s1"]


def test_from_settings_uses_snapshot_dir_and_mirrors_only_when_s3_is_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPSHOT_DIR", str(tmp_path / "snaps"))
    monkeypatch.delenv("S3_ENDPOINT", raising=False)
    monkeypatch.delenv("S3_BUCKET", raising=False)
    store = SnapshotStore.from_settings(Settings.from_env(tmp_path))
    request_close(store)
    assert store.root == tmp_path / "snaps" and store.mirror is None
    take(store, SnapshotRef(AV, "vm-1", "s1", "t"))
    assert (tmp_path / "snaps" / AV / "vm-1" / "s1" / "meta.json").is_file()


# -- background sealing ---------------------------------------------------------------


def test_commit_returns_before_the_seal_and_the_seal_adds_the_big_checksums(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SealGate(monkeypatch)
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref, sealed=False)  # would hang here if commit waited for the seal
    assert gate.entered.wait(10)

    meta = read_meta_file(path)
    assert meta is not None and meta["sealed"] is False
    assert set(meta["sha256"]) == {"snapshot", "vmm.json"}  # the small ones only
    assert meta["sizes"] == {"snapshot": 4096, "mem": 32 << 20, "rootfs": 64 << 20, "vmm.json": 22}
    # usable right away: resume must not wait for the seal
    assert store.locate(ref) == path
    assert store.verify(ref, allow_unsealed=True)
    assert not store.wait_sealed(ref, 0.2)

    gate.open.set()
    assert store.wait_sealed(ref, 30)
    sealed = read_meta_file(path)
    assert sealed is not None and sealed["sealed"] is True
    assert set(sealed["sha256"]) == {"snapshot", "mem", "rootfs", "vmm.json"}
    # The job leaves the queue just after it sealed (it queues the upload first).
    assert store.verify(ref) and store.flush_seals(30) and store.pending_seals() == 0


def test_verify_seals_an_unsealed_snapshot_first_unless_asked_not_to(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SealGate(monkeypatch)
    gate.fail = True  # the worker cannot seal: only verify/seal_now in this thread can
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref, sealed=False)
    assert store.verify(ref, allow_unsealed=True)
    assert read_meta_file(path)["sealed"] is False  # type: ignore[index]

    assert store.verify(ref)  # seals, then checks every checksum
    assert read_meta_file(path)["sealed"] is True  # type: ignore[index]
    # and now the checksums catch what the structural check cannot see
    with open(path / "mem", "r+b") as f:
        f.seek((32 << 20) // 3 + 7)
        f.write(b"\xff")
    assert store.verify(ref, allow_unsealed=True) is False
    assert not store.verify(ref)


def test_unsealed_snapshot_with_a_wrong_size_fails_verify_and_is_never_sealed(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SealGate(monkeypatch)
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref, sealed=False)
    assert gate.entered.wait(10)
    os.truncate(path / "rootfs", 4096)
    assert not store.verify(ref, allow_unsealed=True)
    gate.open.set()
    assert store.flush(10)  # the seal job gave up rather than checksum damaged data
    assert read_meta_file(path)["sealed"] is False  # type: ignore[index]
    assert not store.verify(ref)
    with pytest.raises(BackendError):
        store.seal_now(ref)


def test_seal_now_seals_immediately_and_is_idempotent(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    SealGate(monkeypatch).fail = True
    ref = SnapshotRef(AV, "vm-1", "s1", "tenant-a")
    take(store, ref, sealed=False)
    meta = store.seal_now(ref)
    assert meta["sealed"] is True and store.wait_sealed(ref, 0)
    assert store.seal_now(ref) == meta
    with pytest.raises(NotFound):
        store.seal_now(SnapshotRef(AV, "vm-1", "s1", "tenant-b"))
    with pytest.raises(NotFound):
        store.seal_now(SnapshotRef(AV, "vm-1", "nope", "tenant-a"))


def test_a_restart_reseals_what_was_pending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "snapshots"
    gate = SealGate(monkeypatch)
    gate.fail = True
    first = SnapshotStore(root, None, key=KEY, seal_retry_base_s=60)
    a = SnapshotRef(AV, "vm-1", "a", "t")
    take(first, a, sealed=False)
    assert gate.entered.wait(10)
    # b: the process dies between the publishing rename and releasing the seal job
    monkeypatch.setattr(JobQueue, "release", lambda self, job: None)
    b = SnapshotRef(AV, "vm-1", "b", "t")
    take(first, b, sealed=False)
    first.close(drain_seals=False)  # the "crash": seals still pending on disk
    monkeypatch.undo()
    assert read_meta_file(a.local_dir(root))["sealed"] is False  # type: ignore[index]

    second = SnapshotStore(root, None, key=KEY)
    try:
        assert second.wait_sealed(a, 30) and second.wait_sealed(b, 30)
        assert second.verify(a) and second.verify(b)
        assert second.flush(10) and second.pending_seals() == 0
    finally:
        second.close()


def test_deleting_a_snapshot_with_a_pending_seal_leaves_nothing_behind(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SealGate(monkeypatch)
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref, sealed=False)
    assert gate.entered.wait(10)  # the worker is about to hash it
    store.delete(ref)
    gate.open.set()
    assert store.flush(10) and store.pending_seals() == 0
    assert not path.exists() and not path.parent.exists()
    with pytest.raises(NotFound):
        store.wait_sealed(ref, 1)


def test_close_drains_pending_seals(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snapshots", None, key=KEY)
    refs = [SnapshotRef(AV, "vm-1", f"s{i}", "t") for i in range(3)]
    for ref in refs:
        take(store, ref, sealed=False)
    store.close()
    assert store.pending_seals() == 0
    assert all(read_meta_file(r.local_dir(store.root))["sealed"] for r in refs)  # type: ignore[index]
    assert list((store.root / ".seal-queue").iterdir()) == []


def test_commit_reads_none_of_the_big_artifacts(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commit latency must not grow with the data in mem/rootfs: commit hashes only the small
    artifacts; the big ones are the background seal's (checked by what is read, not by a
    clock)."""
    gate = SealGate(monkeypatch)  # held: the seal waits until we look
    gated = store_module.hash_files
    read_by_commit: list[str] = []

    def spy(paths: Any, *, fsync: bool = False) -> Any:
        if threading.current_thread().name != "pal-seal":
            read_by_commit.extend(paths)
        return gated(paths, fsync=fsync)

    monkeypatch.setattr(store_module, "hash_files", spy)
    ref = SnapshotRef(AV, "vm-1", "big", "t")
    staging = store.staging_dir(ref.snapshot_id)
    (staging / "snapshot").write_bytes(os.urandom(4096))
    with open(staging / "mem", "wb") as f:
        f.truncate(256 << 20)
        f.write(os.urandom(64 << 20))  # 64 MiB of data a synchronous hash would read
    path = store.commit(staging, ref, {})
    assert read_by_commit == ["snapshot"]
    assert read_meta_file(path)["sealed"] is False  # type: ignore[index]
    gate.open.set()
    assert store.wait_sealed(ref, 60)


def test_delete_vm_removes_all_its_snapshots_but_the_kept_and_lists_owners(store: SnapshotStore) -> None:
    a, b, c = (SnapshotRef(AV, "vm-1", s, "t") for s in ("s1", "s2", "s3"))
    other = SnapshotRef(AV, "vm-2", "s9", "t")
    for ref in (a, b, c, other):
        take(store, ref)
    assert store.vms() == {(AV, "vm-1"), (AV, "vm-2")}
    assert store.stored_bytes(a) > 300_000  # what it takes on disk, not its sparse size
    assert sorted(store.delete_vm(AV, "vm-1", keep={"s2"})) == ["s1", "s3"]
    assert [m["snapshotId"] for m in store.list_vm(AV, "vm-1")] == ["s2"]
    assert store.delete_vm(AV, "vm-1") == ["s2"] and not a.local_dir(store.root).parent.exists()
    assert store.vms() == {(AV, "vm-2")} and store.delete_vm(AV, "vm-1") == []


# -- checks before a local restore ----------------------------------------------------


class BigHashes:
    """Counts the hashing of big artifacts (what a restore should not pay when nothing
    changed), whoever does it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        real = store_module.hash_files

        def counting(paths: Any, *, fsync: bool = False) -> Any:
            self.names += [n for n in paths if n in ("mem", "rootfs")]
            return real(paths, fsync=fsync)

        for module in (store_module, store_reads):  # sealing; restore's checks
            monkeypatch.setattr(module, "hash_files", counting)


def _poke(path: Path, data: bytes = b"\xff") -> bytes:
    """Overwrite bytes of an artifact in place (same inode, same size); returns the old."""
    off = (32 << 20) // 3 + 7
    with open(path, "r+b") as f:
        f.seek(off)
        old = f.read(len(data))
        f.seek(off)
        f.write(data)
    return old


def test_a_sealed_mem_changed_after_its_seal_is_refused_before_a_restore(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref)
    hashes = BigHashes(monkeypatch)
    assert store.open_for_restore(ref) == path
    assert hashes.names == [], "unchanged files (same fingerprints) are not re-hashed"
    old = _poke(path / "mem")
    with pytest.raises(BackendError, match=r"damaged: \['mem'\] fail their checksums"):
        store.open_for_restore(ref)
    assert hashes.names == ["mem"]
    assert store.exists(ref), "nothing is deleted: the operator decides"
    # the same bytes put back (a new mtime and ctime): re-hashed once, accepted, and its
    # fingerprint recorded again, so the next restore is cheap again
    _poke(path / "mem", old)
    assert store.open_for_restore(ref) == path
    assert store.open_for_restore(ref) == path
    assert hashes.names == ["mem", "mem"]
    assert store.verify(ref)


def test_a_restore_right_after_the_pause_loads_the_files_committed_and_never_a_changed_one(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SealGate(monkeypatch)
    gate.fail = True  # the background seal cannot run
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref, sealed=False)
    assert read_meta_file(path)["sealed"] is False  # type: ignore[index]
    # Unsealed but unchanged since the commit (its signed fingerprints): loaded at once,
    # without waiting for a checksum there is nothing yet to compare with.
    assert store.open_for_restore(ref) == path
    assert read_meta_file(path)["sealed"] is False  # type: ignore[index]
    # changed between the capture and the seal: the file is not the one captured (its
    # fingerprint at commit), so it is hashed now, never sealed, never loaded
    other = SnapshotRef(AV, "vm-1", "s2", "t")
    path2 = take(store, other, sealed=False)
    _poke(path2 / "rootfs")
    with pytest.raises(BackendError, match=r"rootfs.*changed after the capture"):
        store.open_for_restore(other)
    assert read_meta_file(path2)["sealed"] is False  # type: ignore[index]
    assert not store.verify(other)


def test_a_restore_does_not_wait_for_the_background_seal_under_way(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SealGate(monkeypatch)
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref, sealed=False)
    assert gate.entered.wait(10)  # the worker is sealing it (held before hashing)
    assert store.open_for_restore(ref) == path, "the files are the ones committed"
    gate.open.set()


def test_an_unsigned_local_meta_is_refused_unless_it_predates_the_nodes_key(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    first = SnapshotStore(root, None, key=KEY)
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(first, ref)
    first.close()
    meta = read_meta_file(path)
    assert meta is not None
    (path / META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if k != "mac"}))
    written = os.stat(path / META_FILE).st_ctime_ns
    # the node has had its key since before this meta.json was written: a forgery
    after_key = SnapshotStore(root, None, key=KEY, signed_since_ns=written - 1)
    try:
        with pytest.raises(BackendError, match="not signed"):
            after_key.open_for_restore(ref)
        assert not after_key.exists(ref) and not after_key.verify(ref)
    finally:
        after_key.close()
    # written before the node had a key: a Pal from before signing; checked in full (its
    # fingerprints are not known), then signed
    before_key = SnapshotStore(root, None, key=KEY, signed_since_ns=written + 1)
    try:
        assert before_key.open_for_restore(ref) == path
        assert "mac" in read_meta_file(path)  # type: ignore[operator]
    finally:
        before_key.close()


def test_the_store_of_a_node_knows_since_when_it_signs(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    s = SnapshotStore.from_settings(settings)
    try:
        assert s._signed_since_ns == os.stat(settings.snapshot_key_path).st_mtime_ns
    finally:
        s.close()


class MetaOnlyBucket:
    """An S3 mirror that holds one snapshot's meta.json (what ``restorable`` reads)."""

    def __init__(self, meta: dict[str, Any] | None) -> None:
        self.meta = meta

    def read_meta(self, ref: SnapshotRef) -> dict[str, Any] | None:
        return self.meta


def test_a_snapshot_only_s3_holds_is_restorable_and_a_broken_local_copy_is_not(
    store: SnapshotStore,
) -> None:
    """What the snapshot audit asks a node before it fails a paused VM: a copy cleaned
    from the node's disk but sealed in S3 is one a resume downloads, so the VM stays
    paused; a local copy that fails its checks is what a resume would load, so it is not."""
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref)
    meta = store.read_meta(ref)
    for artifact in path.iterdir():
        artifact.unlink()
    path.rmdir()
    assert not store.restorable(ref)  # no S3: gone is gone
    try:
        store.mirror = MetaOnlyBucket(meta)  # type: ignore[assignment]
        assert store.restorable(ref)
        assert not store.restorable(SnapshotRef(AV, "vm-1", "s1", "another-tenant"))
        store.mirror = MetaOnlyBucket({**meta, "sealed": False})  # type: ignore[assignment]
        with pytest.raises(BackendError, match="not authentic"):
            store.restorable(ref)  # an altered meta: not known restorable, not known gone
        store.mirror = MetaOnlyBucket(None)  # type: ignore[assignment]
        assert not store.restorable(ref)

        store.mirror = None
        local = take(store, SnapshotRef(AV, "vm-1", "s2", "t"))
        store.mirror = MetaOnlyBucket(meta)  # type: ignore[assignment]
        os.truncate(local / "rootfs", (64 << 20) - 4096)
        assert not store.restorable(SnapshotRef(AV, "vm-1", "s2", "t"))
    finally:
        store.mirror = None
