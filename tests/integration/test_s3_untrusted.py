"""Issue 9 item 4: snapshots from S3 are untrusted input. Whoever can write the bucket
must not write files on a node, swap one tenant's snapshot for another's, or get
tampered bytes restored (real S3 server: moto)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.errors import BackendError
from pal.snapshots.integrity import sign_meta
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.store import SnapshotStore
from tests.integration.test_s3_mirror import AV, KEY, mirror_for, take
from tests.s3server import TEST_ENV, S3Server

pytestmark = pytest.mark.s3


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TEST_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def bucket(request: pytest.FixtureRequest) -> str:
    return "pal-u-" + request.node.name.replace("_", "-")[:40].lower()


@pytest.fixture
def node_a(tmp_path: Path, s3_server: S3Server, bucket: str) -> Iterator[SnapshotStore]:
    s = SnapshotStore(tmp_path / "a" / "snapshots", mirror_for(s3_server.endpoint, bucket), key=KEY)
    yield s
    s.close()


def node(tmp_path: Path, s3_server: S3Server, bucket: str, name: str, key: bytes = KEY) -> SnapshotStore:
    """Another node on the same bucket, with its own empty local tier."""
    return SnapshotStore(tmp_path / name / "snapshots", mirror_for(s3_server.endpoint, bucket), key=key)


def uploaded(store: SnapshotStore, ref: SnapshotRef) -> dict[str, bytes]:
    _, contents = take(store, ref)
    assert store.flush(60)
    return contents


def put_meta(store: SnapshotStore, ref: SnapshotRef, meta: dict) -> None:
    assert store.mirror is not None
    store.mirror._client.put_object(
        Bucket=store.mirror.bucket, Key=ref.s3_key("meta.json"), Body=json.dumps(meta).encode()
    )


def get_meta(store: SnapshotStore, ref: SnapshotRef) -> dict:
    assert store.mirror is not None
    meta = store.mirror.read_meta(ref)
    assert meta is not None
    return meta


def test_a_node_with_the_key_restores_a_snapshot_another_node_uploaded(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-ok", "t")
    contents = uploaded(node_a, ref)
    b = node(tmp_path, s3_server, bucket, "b")
    try:
        path = b.open_for_restore(ref)
        assert {n: (path / n).read_bytes() for n in contents} == contents
    finally:
        b.close()
    stranger = node(tmp_path, s3_server, bucket, "c", key=b"x" * 32)
    try:
        with pytest.raises(BackendError, match="not authentic"):
            stranger.open_for_restore(ref)
        assert not stranger.path(ref).exists()
    finally:
        stranger.close()


def test_artifact_names_from_s3_never_become_paths(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    """A meta.json naming '../../x' (even one signed with the right key) writes nothing."""
    ref = SnapshotRef(AV, "vm-1", "snap-escape", "t")
    uploaded(node_a, ref)
    meta = get_meta(node_a, ref)
    b = node(tmp_path, s3_server, bucket, "b")
    target = tmp_path / "b" / "pwned"
    try:
        for name in ("../../pwned", "/tmp/pal-pwned", "mem/../../../pwned", "meta.json"):
            evil = dict(meta)
            evil["sizes"] = {**meta["sizes"], name: 5}
            evil["sha256"] = {**meta["sha256"], name: "0" * 64}
            for forged in (evil, sign_meta(evil, KEY)):  # unsigned, and signed by a leaked key
                put_meta(node_a, ref, forged)
                with pytest.raises(BackendError, match="refused"):
                    b.open_for_restore(ref)
        assert not target.exists() and not Path("/tmp/pal-pwned").exists()
        assert not b.path(ref).exists()
        assert list((b.root / ".staging").iterdir()) == []
    finally:
        b.close()


def test_a_forged_or_replayed_meta_is_refused(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    mine = SnapshotRef(AV, "vm-mine", "snap-mine", "tenant-a")
    theirs = SnapshotRef(AV, "vm-theirs", "snap-theirs", "tenant-b")
    uploaded(node_a, mine)
    uploaded(node_a, theirs)
    b = node(tmp_path, s3_server, bucket, "b")
    try:
        # Take over another tenant's snapshot by editing its owner: the mac no longer fits.
        meta = get_meta(node_a, theirs)
        put_meta(node_a, theirs, {**meta, "tenantId": "tenant-a"})
        with pytest.raises(BackendError, match="not authentic"):
            b.open_for_restore(SnapshotRef(AV, "vm-theirs", "snap-theirs", "tenant-a"))
        # Replay: copy tenant-a's authentic meta over the other snapshot's path.
        put_meta(node_a, theirs, get_meta(node_a, mine))
        with pytest.raises(BackendError, match="another snapshot"):
            b.open_for_restore(SnapshotRef(AV, "vm-theirs", "snap-theirs", "tenant-a"))
        # No mac at all.
        unsigned = {k: v for k, v in meta.items() if k != "mac"}
        put_meta(node_a, theirs, unsigned)
        with pytest.raises(BackendError, match="not authentic"):
            b.open_for_restore(theirs)
        assert not b.path(theirs).exists()
    finally:
        b.close()


def test_tampered_artifacts_from_s3_are_never_published(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-tamper", "t")
    uploaded(node_a, ref)
    assert node_a.mirror is not None
    client, bkt = node_a.mirror._client, node_a.mirror.bucket
    b = node(tmp_path, s3_server, bucket, "b")
    try:
        for name in ("snapshot", "vmm.json"):  # raw objects
            good = client.get_object(Bucket=bkt, Key=ref.s3_key(name))["Body"].read()
            client.put_object(Bucket=bkt, Key=ref.s3_key(name), Body=good[:-1] + bytes([good[-1] ^ 1]))
            with pytest.raises(BackendError, match="checksums"):
                b.open_for_restore(ref)
            client.put_object(Bucket=bkt, Key=ref.s3_key(name), Body=good)
        # A sparse object claiming a huge size is refused before anything is allocated.
        obj = client.get_object(Bucket=bkt, Key=ref.s3_key("mem"))
        body, md = obj["Body"].read(), obj["Metadata"]
        huge = body[:8] + (1 << 50).to_bytes(8, "little") + body[16:]
        client.put_object(Bucket=bkt, Key=ref.s3_key("mem"), Body=huge, Metadata=md)
        with pytest.raises(BackendError):
            b.open_for_restore(ref)
        assert not b.path(ref).exists() and list((b.root / ".staging").iterdir()) == []
        client.put_object(Bucket=bkt, Key=ref.s3_key("mem"), Body=body, Metadata=md)
        assert b.open_for_restore(ref) == b.path(ref)
    finally:
        b.close()


def test_local_meta_and_device_state_are_checked_before_a_restore(node_a: SnapshotStore) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-local", "tenant-a")
    path, _ = take(node_a, ref)
    meta = json.loads((path / "meta.json").read_text())
    # Ownership edited in place: refused, and never re-signed by a seal.
    (path / "meta.json").write_text(json.dumps({**meta, "tenantId": "tenant-b"}))
    with pytest.raises(BackendError, match="not authentic"):
        node_a.open_for_restore(SnapshotRef(AV, "vm-1", "snap-local", "tenant-b"))
    assert not node_a.verify(ref)
    (path / "meta.json").write_text(json.dumps(meta))
    # Device state (what QEMU parses) flipped: caught before load.
    state = (path / "snapshot").read_bytes()
    (path / "snapshot").write_bytes(bytes([state[0] ^ 0xFF]) + state[1:])
    with pytest.raises(BackendError, match="damaged"):
        node_a.open_for_restore(ref)
    (path / "snapshot").write_bytes(state)
    assert node_a.open_for_restore(ref) == path


def test_fork_children_map_a_copy_never_the_snapshot_artifact(node_a: SnapshotStore) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-fork", "t")
    path, contents = take(node_a, ref)
    mem = node_a.fork_mem(ref)
    assert mem != path / "mem" and mem.read_bytes() == contents["mem"]
    assert node_a.fork_mem(ref) == mem, "one copy per snapshot, shared by its children"
    with open(mem, "r+b") as f:  # what an escaped child could do to the file it maps
        f.seek(8 << 20)
        f.write(b"evil")
    assert (path / "mem").read_bytes() == contents["mem"]
    assert node_a.verify(ref)
    assert node_a.prune_fork_mem({"snap-fork"}) == []
    assert node_a.prune_fork_mem(set()) == ["snap-fork.mem"]
    assert not mem.exists()
    os.sync()
    shutil.rmtree(path)
