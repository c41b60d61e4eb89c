"""The local snapshot store: atomic commit, verification, ownership, retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pal.config import Settings
from pal.errors import Conflict, InvalidRequest, NotFound
from pal.snapshots.layout import META_FILE, SnapshotRef
from pal.snapshots.local import LocalTier
from pal.snapshots.store import SnapshotStore

AV = "default-0123456789ab"
DAY = 24 * 3600.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def write_artifacts(staging: Path, *, mem: bool = True, rootfs: bool = True) -> dict[str, bytes]:
    """Device state, a sparse 32 MiB mem and a sparse 64 MiB disk, like a small VM's."""
    written = {"snapshot": os.urandom(4096)}
    (staging / "snapshot").write_bytes(written["snapshot"])
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


def take(store: SnapshotStore, ref: SnapshotRef, **meta: object) -> Path:
    staging = store.staging_dir(ref.snapshot_id)
    write_artifacts(staging)
    return store.commit(staging, ref, {"qemuVersion": "7.2.22", "kernelVersion": "6.1.0-28", **meta})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots", None, clock=clock)


def test_commit_publishes_a_complete_verified_snapshot(store: SnapshotStore) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-1", "tenant-a")
    staging = store.staging_dir("snap-1")
    written = write_artifacts(staging)
    path = store.commit(staging, ref, {"parentSnapshotId": "snap-0", "qemuVersion": "7.2.22"})

    assert path == store.root / AV / "vm-1" / "snap-1"
    assert not staging.exists()
    assert sorted(p.name for p in path.iterdir()) == ["mem", "meta.json", "rootfs", "snapshot"]
    assert (path / "snapshot").read_bytes() == written["snapshot"]
    assert store.exists(ref) and store.verify(ref) and store.verify(path)
    assert store.locate(ref) == path
    meta = store.read_meta(ref)
    assert meta["tenantId"] == "tenant-a" and meta["vmId"] == "vm-1"
    assert meta["parentSnapshotId"] == "snap-0" and meta["qemuVersion"] == "7.2.22"
    assert meta["hashAlgo"] == "sha256-sparse-v1"
    assert meta["sizes"] == {"snapshot": 4096, "mem": 32 << 20, "rootfs": 64 << 20}
    assert set(meta["sha256"]) == {"snapshot", "mem", "rootfs"}
    assert meta["createdAt"] == "2027-01-15T08:00:00Z"
    # sparse artifacts stay sparse (the store never rewrites them)
    assert os.stat(path / "rootfs").st_blocks * 512 < 8 << 20


def test_mem_and_rootfs_are_optional_but_device_state_is_not(store: SnapshotStore) -> None:
    staging = store.staging_dir("s-legacy")
    write_artifacts(staging, mem=False, rootfs=False)
    path = store.commit(staging, SnapshotRef(AV, "vm-1", "s-legacy", "t"), {"memory": "stream"})
    assert store.verify(path) and store.read_meta(SnapshotRef(AV, "vm-1", "s-legacy"))["sizes"].keys() == {
        "snapshot"
    }

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
    # a restarted manager clears it
    restarted = SnapshotStore(store.root, None)
    assert restarted.cleanup_staging() == [staging.name]
    assert not staging.exists()


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


@pytest.mark.parametrize("artifact", ["snapshot", "mem", "rootfs"])
def test_verify_catches_a_flipped_byte(store: SnapshotStore, artifact: str) -> None:
    ref = SnapshotRef(AV, "vm-1", "s1", "t")
    path = take(store, ref)
    target = path / artifact
    with open(target, "r+b") as f:
        offset = 100 if artifact == "snapshot" else os.stat(target).st_size // 3 + 5
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
    for call in (store.locate, store.read_meta, store.check_owner, store.delete):
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


def test_commit_runs_retention_keeping_protected_snapshots(tmp_path: Path, clock: FakeClock) -> None:
    protected: set[str] = {"s0"}  # e.g. what a live fork still maps
    store = SnapshotStore(
        tmp_path / "snapshots", None, clock=clock, protected_provider=lambda av, vm: protected
    )
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
    assert store.root == tmp_path / "snaps" and store.mirror is None
    take(store, SnapshotRef(AV, "vm-1", "s1", "t"))
    assert (tmp_path / "snaps" / AV / "vm-1" / "s1" / "meta.json").is_file()
