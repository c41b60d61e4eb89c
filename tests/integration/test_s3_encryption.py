"""Issue 23 item 7: snapshots in S3 are encrypted on the node (pal/snapshots/crypt.py).
Whoever reads the bucket reads no guest data; whoever writes it cannot get a tampered,
truncated or swapped chunk restored; a rotation of the key rewraps the data keys only.
Real S3-compatible server (moto); the VM-level check is tests/integration/test_s3_resume.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pal.errors import BackendError
from pal.snapshots import crypt
from pal.snapshots.layout import ENCRYPTED_ENCODING, SnapshotRef
from pal.snapshots.s3 import S3Mirror
from pal.snapshots.sparse_object import SparseEncoder
from pal.snapshots.store import SnapshotStore
from tests.integration.test_s3_mirror import AV, KEY
from tests.s3server import TEST_ENV, S3Server

pytestmark = pytest.mark.s3

ENC_KEY = b"E" * 32  # the snapshot encryption key every node of the bucket holds
MiB = 1 << 20
ARTIFACTS = ("snapshot", "mem", "rootfs", "vmm.json")


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TEST_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def bucket(request: pytest.FixtureRequest) -> str:
    return "pal-e-" + request.node.name.replace("_", "-").replace("[", "-").replace("]", "")[:40].lower()


def node(
    tmp_path: Path, s3: S3Server, bucket: str, name: str, enc_key: bytes | None = ENC_KEY, **kw: Any
) -> SnapshotStore:
    """A node on the bucket with its own empty local tier (a fresh data dir)."""
    mirror = S3Mirror(
        s3.endpoint,
        bucket,
        "us-east-1",
        retry_base_s=0.2,
        retry_max_s=1.0,
        connect_timeout_s=1.0,
        read_timeout_s=10.0,
        encryption_key=enc_key,
        **kw,
    )
    return SnapshotStore(tmp_path / name / "snapshots", mirror, key=KEY)


@pytest.fixture
def node_a(tmp_path: Path, s3_server: S3Server, bucket: str) -> Iterator[SnapshotStore]:
    s = node(tmp_path, s3_server, bucket, "a")
    yield s
    s.close()


def take(store: SnapshotStore, ref: SnapshotRef, marker: bytes) -> dict[str, bytes]:
    """A snapshot whose device state, RAM and disk hold ``marker`` (a sparse 2 GiB disk)."""
    staging = store.staging_dir(ref.snapshot_id)
    (staging / "snapshot").write_bytes(os.urandom(4096) + marker + os.urandom(4096))
    (staging / "vmm.json").write_text('{"memoryKind": "file"}')
    for name, size, offsets in (("mem", 64 * MiB, (0, 9 * MiB + 5)), ("rootfs", 2048 * MiB, (40 * MiB,))):
        with open(staging / name, "wb") as f:
            f.truncate(size)
            for off in offsets:
                f.seek(off)
                f.write(os.urandom(3000) + marker * 50 + os.urandom(MiB))
    path = store.commit(staging, ref, {"qemuVersion": "7.2.22"})
    contents = {name: (path / name).read_bytes() for name in ARTIFACTS}
    assert store.flush(120)
    return contents


def objects(store: SnapshotStore, ref: SnapshotRef) -> dict[str, tuple[bytes, dict[str, str]]]:
    assert store.mirror is not None
    client, bkt = store.mirror._client, store.mirror.bucket
    out = {}
    for key in store.mirror._list_keys(ref.s3_prefix):
        obj = client.get_object(Bucket=bkt, Key=key)
        out[key.rsplit("/", 1)[1]] = (obj["Body"].read(), obj["Metadata"])
    return out


def put(store: SnapshotStore, ref: SnapshotRef, name: str, body: bytes, metadata: dict[str, str]) -> None:
    assert store.mirror is not None
    store.mirror._client.put_object(
        Bucket=store.mirror.bucket, Key=ref.s3_key(name), Body=body, Metadata=metadata
    )


def refused_cleanly(store: SnapshotStore, ref: SnapshotRef, match: str) -> None:
    """The restore fails with ``match`` in its error, and nothing of it is left on the node."""
    with pytest.raises(BackendError, match=match):
        store.open_for_restore(ref)
    assert not store.path(ref).exists()
    assert list((store.root / ".staging").iterdir()) == []


def test_the_bucket_holds_no_plaintext_and_a_fresh_node_restores_it(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    marker = b"pal-guest-secret-" + os.urandom(8).hex().encode()
    ref = SnapshotRef(AV, "vm-1", "snap-enc", "t")
    contents = take(node_a, ref, marker)
    stored = objects(node_a, ref)
    assert set(stored) == {*ARTIFACTS, "meta.json", "key.json"}
    for name, (body, metadata) in stored.items():
        assert marker not in body, f"{name} holds the guest's plaintext"
        if name in ARTIFACTS:
            assert metadata == {"pal-encoding": ENCRYPTED_ENCODING}
    assert json.loads(stored["meta.json"][0])["s3Encryption"] == "pal-enc-v1"
    # Sparse upload still: 2 GiB of disk with ~1 MiB of data.
    assert len(stored["rootfs"][0]) < 4 * MiB

    fresh = node(tmp_path, s3_server, bucket, "fresh")
    try:
        path = fresh.open_for_restore(ref)
        assert {n: (path / n).read_bytes() for n in ARTIFACTS} == contents
        assert os.stat(path / "rootfs").st_blocks * 512 < 16 * MiB  # holes stayed holes
        assert fresh.verify(ref)
    finally:
        fresh.close()

    # The same search finds the marker in a snapshot uploaded with encryption off.
    plain = node(tmp_path, s3_server, bucket, "plain", encrypt=False)
    try:
        pref = SnapshotRef(AV, "vm-2", "snap-plain", "t")
        take(plain, pref, marker)
        found = {n for n, (body, _) in objects(plain, pref).items() if marker in body}
        assert found == {"snapshot", "mem", "rootfs"}
    finally:
        plain.close()


def _flip_chunk(body: bytes, index: int) -> bytes:
    start, _ = crypt.chunk_span(index)
    return body[: start + 7] + bytes([body[start + 7] ^ 0x40]) + body[start + 8 :]


@pytest.mark.parametrize(
    ("name", "edit", "match"),
    [
        pytest.param("mem", lambda b: _flip_chunk(b, 1), "chunk 1 of .*/mem does not auth", id="chunk"),
        pytest.param("snapshot", lambda b: _flip_chunk(b, 0), "chunk 0 of .*/snapshot", id="device-state"),
        pytest.param("mem", lambda b: b[: crypt.chunk_span(2)[0]], "does not authenticate", id="truncated"),
        pytest.param("rootfs", lambda b: b[: len(b) - 3], "does not authenticate", id="truncated-end"),
        pytest.param("mem", lambda b: b[: crypt.HEADER_BYTES], "truncated", id="header-only"),
    ],
)
def test_a_tampered_or_truncated_object_fails_the_restore(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str, name: str, edit: Any, match: str
) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-t", "t")
    contents = take(node_a, ref, b"m")
    body, metadata = objects(node_a, ref)[name]
    assert len(body) > crypt.chunk_span(2)[1] or name != "mem"
    b = node(tmp_path, s3_server, bucket, "b")
    try:
        put(node_a, ref, name, edit(body), metadata)
        refused_cleanly(b, ref, match)
        put(node_a, ref, name, body, metadata)  # put back: it restores
        path = b.open_for_restore(ref)
        assert (path / name).read_bytes() == contents[name]
    finally:
        b.close()


def test_chunks_and_keys_swapped_between_two_snapshots_fail_the_restore(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    one, two = SnapshotRef(AV, "vm-1", "snap-1", "t"), SnapshotRef(AV, "vm-1", "snap-2", "t")
    take(node_a, one, b"one")
    take(node_a, two, b"two")
    a, b_ = objects(node_a, one), objects(node_a, two)
    b = node(tmp_path, s3_server, bucket, "b")
    try:
        # Chunk 1 of snapshot two's mem in place of snapshot one's.
        start, end = crypt.chunk_span(1)
        mixed = a["mem"][0][:start] + b_["mem"][0][start:end] + a["mem"][0][end:]
        put(node_a, one, "mem", mixed, a["mem"][1])
        refused_cleanly(b, one, "chunk 1 of .*snap-1/mem does not authenticate")
        # The whole mem object of snapshot two.
        put(node_a, one, "mem", b_["mem"][0], a["mem"][1])
        refused_cleanly(b, one, "does not authenticate")
        put(node_a, one, "mem", a["mem"][0], a["mem"][1])
        # Snapshot two's key.json (and its objects, all of them) under snapshot one.
        put(node_a, one, "key.json", b_["key.json"][0], {})
        refused_cleanly(b, one, "belongs to another snapshot")
        put(node_a, one, "key.json", a["key.json"][0], {})
        assert b.open_for_restore(one) == b.path(one)
    finally:
        b.close()


def test_a_plaintext_object_in_an_encrypted_snapshot_is_refused(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    """Swapping an encrypted object for a plaintext one (even of the right bytes) is refused:
    the meta.json, under its HMAC, says the snapshot is encrypted."""
    ref = SnapshotRef(AV, "vm-1", "snap-d", "t")
    take(node_a, ref, b"m")
    with SparseEncoder(node_a.path(ref) / "mem") as enc:
        sparse = enc.read()
    put(node_a, ref, "mem", sparse, {"pal-encoding": "pal-sparse-v1"})
    b = node(tmp_path, s3_server, bucket, "b")
    try:
        refused_cleanly(b, ref, "says the snapshot is encrypted")
    finally:
        b.close()


def test_a_node_with_another_key_or_none_cannot_restore(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-k", "t")
    take(node_a, ref, b"m")
    for name, key in (("wrong", b"W" * 32), ("none", None)):
        other = node(tmp_path, s3_server, bucket, name, enc_key=key)
        try:
            refused_cleanly(other, ref, "PAL_SNAPSHOT_ENCRYPTION_KEY_FILE")
        finally:
            other.close()


def test_an_unencrypted_snapshot_from_before_still_restores(
    tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    old = node(tmp_path, s3_server, bucket, "old", enc_key=None)  # a node from before encryption
    ref = SnapshotRef(AV, "vm-1", "snap-old", "t")
    try:
        contents = take(old, ref, b"m")
        assert "key.json" not in objects(old, ref)
    finally:
        old.close()
    new = node(tmp_path, s3_server, bucket, "new")
    try:
        path = new.open_for_restore(ref)
        assert {n: (path / n).read_bytes() for n in ARTIFACTS} == contents
    finally:
        new.close()


def test_one_chunk_of_an_object_opens_from_a_ranged_get(node_a: SnapshotStore) -> None:
    ref = SnapshotRef(AV, "vm-1", "snap-r", "t")
    contents = take(node_a, ref, b"m")
    assert node_a.mirror is not None
    client, bkt = node_a.mirror._client, node_a.mirror.bucket
    data_key = crypt.unwrap(node_a.mirror.read_key_object(ref) or b"", ENC_KEY, ref)
    key = ref.s3_key("mem")
    header = client.get_object(Bucket=bkt, Key=key, Range=f"bytes=0-{crypt.HEADER_BYTES - 1}")["Body"].read()
    start, end = crypt.chunk_span(1)
    sealed = client.get_object(Bucket=bkt, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()
    plain = crypt.open_chunk(data_key, crypt.artifact_identity(ref, "mem"), header, 1, sealed, last=False)
    # Chunk 1 is bytes [1 MiB, 2 MiB) of the mem object's sparse stream: after its 16-byte
    # header and a 16-byte record header, that is the end of the file's first 1 MiB block,
    # the next record's header, then the start of the file's second block.
    mem = contents["mem"]
    assert plain[:32] == mem[MiB - 32 : MiB] and plain[48:] == mem[MiB : 2 * MiB - 48]


def test_a_complete_upload_is_not_sent_again(node_a: SnapshotStore) -> None:
    """A second upload (the queue's and ensure_uploaded's) would replace the data key
    under a reader's feet: S3's complete copy stays as it is."""
    ref = SnapshotRef(AV, "vm-1", "snap-u", "t")
    take(node_a, ref, b"m")
    assert node_a.mirror is not None
    before = node_a.mirror.read_key_object(ref)
    node_a.mirror.upload(ref, node_a.path(ref))
    node_a.ensure_uploaded(ref)
    assert node_a.mirror.read_key_object(ref) == before


def _rekey_cli(tmp_path: Path, s3: S3Server, bucket: str, old: Path, new: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "S3_ENDPOINT": s3.endpoint,
        "S3_BUCKET": bucket,
        "PAL_DATA_DIR": str(tmp_path / "operator"),
    }
    argv = [sys.executable, "-m", "pal.cli.main", "snapshots", "rekey"]
    out = subprocess.run(
        [*argv, "--old-key-file", str(old), "--new-key-file", str(new)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_rotation_rewraps_the_data_keys_only_and_the_old_key_no_longer_opens_them(
    node_a: SnapshotStore, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    refs = [SnapshotRef(AV, "vm-1", f"snap-{i}", "t") for i in range(2)]
    contents = {ref: take(node_a, ref, b"m") for ref in refs}
    old_node = node(tmp_path, s3_server, bucket, "old", enc_key=None)  # from before encryption
    try:
        take(old_node, SnapshotRef(AV, "vm-old", "snap-plain", "t"), b"m")
    finally:
        old_node.close()
    before = {ref: objects(node_a, ref) for ref in refs}
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    old_file, new_file = keys / "old.key", keys / "new.key"
    old_file.write_bytes(ENC_KEY)
    old_file.chmod(0o600)

    report = _rekey_cli(tmp_path, s3_server, bucket, old_file, new_file)
    new_key = new_file.read_bytes()
    assert report["rewrapped"] == 2 and report["failed"] == {}
    assert report["unencrypted"] == [f"{AV}/vm-old/snap-plain"]
    assert report["newKeyId"] == crypt.key_id(new_key) and report["oldKeyId"] == crypt.key_id(ENC_KEY)
    for ref in refs:
        after = objects(node_a, ref)
        changed = {n for n in after if after[n] != before[ref][n]}
        assert changed == {"key.json"}, "only the wrapped data key is rewritten"

    stale = node(tmp_path, s3_server, bucket, "stale")  # still holds the old key
    rotated = node(tmp_path, s3_server, bucket, "rotated", enc_key=new_key)
    try:
        for ref in refs:
            refused_cleanly(stale, ref, "encrypted under snapshot encryption key")
            path = rotated.open_for_restore(ref)
            assert {n: (path / n).read_bytes() for n in ARTIFACTS} == contents[ref]
    finally:
        stale.close()
        rotated.close()
    # Idempotent: a second run (after every node holds the new key) finds them done.
    again = _rekey_cli(tmp_path, s3_server, bucket, old_file, new_file)
    assert again["rewrapped"] == 0 and again["alreadyNewKey"] == 2


@pytest.mark.parametrize(
    ("sse", "kms_key"), [("AES256", None), ("aws:kms", "arn:aws:kms:us-east-1:123456789012:key/pal-test")]
)
def test_server_side_encryption_is_requested_on_every_object(
    tmp_path: Path, s3_server: S3Server, bucket: str, sse: str, kms_key: str | None
) -> None:
    """PAL_S3_SSE: the request parameters, as far as the S3 test server (moto) records them;
    a real KMS cannot be reached here."""
    store = node(tmp_path, s3_server, bucket, "sse", sse=sse, sse_kms_key_id=kms_key)
    ref = SnapshotRef(AV, "vm-1", "snap-sse", "t")
    try:
        take(store, ref, b"m")
        assert store.mirror is not None
        client = store.mirror._client
        names = store.mirror._list_keys(ref.s3_prefix)
        assert len(names) == 6
        for key in names:
            head = client.head_object(Bucket=store.mirror.bucket, Key=key)
            assert head.get("ServerSideEncryption") == sse, key
            if kms_key:
                assert head.get("SSEKMSKeyId") == kms_key, key
        shutil.rmtree(store.path(ref))
        assert store.open_for_restore(ref) == store.path(ref)
    finally:
        store.close()
