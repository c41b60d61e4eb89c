"""pal-enc-v1 (pal/snapshots/crypt.py): chunked AEAD of snapshot objects, and the wrapped
data keys. Pure logic; the S3 round trips are in tests/integration/test_s3_encryption.py."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from pal.snapshots import crypt
from pal.snapshots.layout import SnapshotRef

REF = SnapshotRef("default-0123456789ab", "vm-1", "snap-1")
OTHER = SnapshotRef("default-0123456789ab", "vm-1", "snap-2")
KEY = b"e" * 32
CHUNK = crypt.MIN_CHUNK_BYTES


def seal(plain: bytes, data_key: bytes, identity: bytes = b"av/vm/snap/mem") -> bytes:
    return crypt.EncryptingReader(io.BytesIO(plain).read, data_key, identity, CHUNK).read()


def open_all(sealed: bytes, data_key: bytes, identity: bytes = b"av/vm/snap/mem", step: int = 1000) -> bytes:
    reader = crypt.DecryptingReader(io.BytesIO(sealed).read, data_key, identity)
    out = bytearray()
    while got := reader.read(step):
        out += got
    return bytes(out)


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 17])
def test_round_trip_at_every_chunk_boundary(size: int) -> None:
    dk = crypt.new_data_key()
    plain = os.urandom(size)
    sealed = seal(plain, dk)
    chunks = max(1, -(-size // CHUNK))
    assert len(sealed) == crypt.HEADER_BYTES + size + chunks * crypt.TAG_BYTES
    assert open_all(sealed, dk) == plain


def test_the_ciphertext_does_not_hold_the_plaintext() -> None:
    marker = b"pal-secret-marker-" + os.urandom(8).hex().encode()
    plain = (b"\0" * 5000 + marker) * 20
    sealed = seal(plain, crypt.new_data_key())
    assert marker not in sealed and marker in plain


def _chunks(sealed: bytes) -> list[bytes]:
    body = sealed[crypt.HEADER_BYTES :]
    step = CHUNK + crypt.TAG_BYTES
    return [body[i : i + step] for i in range(0, len(body), step)]


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda h, c: h + b"".join([*c[:1], bytes([c[1][0] ^ 1]) + c[1][1:], *c[2:]]), id="flip"),
        pytest.param(lambda h, c: h + b"".join([c[1], c[0], *c[2:]]), id="reorder"),
        pytest.param(lambda h, c: h + b"".join(c[:2]), id="truncated-at-a-chunk-boundary"),
        pytest.param(lambda h, c: h + b"".join(c)[:-5], id="truncated-mid-chunk"),
        pytest.param(lambda h, c: h + b"".join(c) + b"x" * 40, id="trailing-bytes"),
        pytest.param(lambda h, c: h + b"".join(c[:2] + c[1:]), id="chunk-duplicated"),
        pytest.param(lambda h, c: h[:8] + (2 * CHUNK).to_bytes(4, "big") + b"".join(c), id="header"),
    ],
)
def test_any_change_to_the_object_fails_to_authenticate(edit) -> None:  # type: ignore[no-untyped-def]
    dk = crypt.new_data_key()
    sealed = seal(os.urandom(3 * CHUNK + 100), dk)
    bad = edit(sealed[: crypt.HEADER_BYTES], _chunks(sealed))
    with pytest.raises(crypt.SnapshotUnreadable):
        open_all(bad, dk)


def test_a_chunk_from_another_snapshot_or_artifact_does_not_open() -> None:
    dk = crypt.new_data_key()
    plain = os.urandom(2 * CHUNK)
    mine = seal(plain, dk, b"av/vm/snap-1/mem")
    for other in (seal(plain, dk, b"av/vm/snap-2/mem"), seal(plain, dk, b"av/vm/snap-1/rootfs")):
        swapped = mine[: crypt.HEADER_BYTES] + _chunks(other)[0] + _chunks(mine)[1]
        with pytest.raises(crypt.SnapshotUnreadable, match="chunk 0"):
            open_all(swapped, dk, b"av/vm/snap-1/mem")
    with pytest.raises(crypt.SnapshotUnreadable):
        open_all(mine, crypt.new_data_key(), b"av/vm/snap-1/mem")


def test_one_chunk_opens_alone_from_its_byte_range() -> None:
    """A ranged GET of chunk i (chunk_span) is enough to read it."""
    dk = crypt.new_data_key()
    plain = os.urandom(3 * CHUNK + 10)
    sealed = seal(plain, dk)
    header = sealed[: crypt.HEADER_BYTES]
    for i, last in ((1, False), (3, True)):
        start, end = crypt.chunk_span(i, CHUNK)
        got = crypt.open_chunk(dk, b"av/vm/snap/mem", header, i, sealed[start:end], last=last)
        assert got == plain[i * CHUNK : (i + 1) * CHUNK]
    start, end = crypt.chunk_span(1, CHUNK)
    with pytest.raises(crypt.SnapshotUnreadable):
        crypt.open_chunk(dk, b"av/vm/snap/mem", header, 2, sealed[start:end], last=False)


def test_the_data_key_is_wrapped_for_one_snapshot_under_one_key() -> None:
    dk = crypt.new_data_key()
    body = crypt.wrap(dk, KEY, REF)
    assert dk not in body and dk.hex().encode() not in body
    assert crypt.unwrap(body, KEY, REF) == dk
    assert crypt.wrapped_key_id(body, REF) == crypt.key_id(KEY)
    with pytest.raises(crypt.SnapshotUnreadable, match="another snapshot"):
        crypt.unwrap(body, KEY, OTHER)
    with pytest.raises(crypt.SnapshotUnreadable, match="encrypted under snapshot encryption key"):
        crypt.unwrap(body, b"w" * 32, REF)
    # A key id edited to match the node's key does not help: the wrap does not open.
    data = json.loads(body)
    data["keyId"] = crypt.key_id(b"w" * 32)
    with pytest.raises(crypt.SnapshotUnreadable, match="does not open"):
        crypt.unwrap(json.dumps(data).encode(), b"w" * 32, REF)
    for junk in (b"", b"[]", b"{" * 10000, b'{"format": "pal-snapshot-key-v1"}', b"x" * 10000):
        with pytest.raises(crypt.SnapshotUnreadable):
            crypt.unwrap(junk, KEY, REF)


def test_rewrap_keeps_the_data_key_and_the_old_key_no_longer_opens_it() -> None:
    dk = crypt.new_data_key()
    new = b"n" * 32
    body = crypt.rewrap(crypt.wrap(dk, KEY, REF), KEY, new, REF)
    assert crypt.unwrap(body, new, REF) == dk
    with pytest.raises(crypt.SnapshotUnreadable):
        crypt.unwrap(body, KEY, REF)


def test_a_node_encrypts_by_default_and_off_is_explicit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pal.config import Settings
    from pal.snapshots.s3 import S3Mirror

    data = tmp_path
    for name in ("PAL_SNAPSHOT_ENCRYPTION", "PAL_S3_SSE", "PAL_SNAPSHOT_ENCRYPTION_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("S3_BUCKET", "pal-default")
    settings = Settings.from_env(data)
    mirror = S3Mirror.from_settings(settings)
    assert mirror.encrypts and settings.s3_sse is None
    key_file = data / "keys" / "snapshot-encryption.key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_bytes()) == 32

    monkeypatch.setenv("PAL_SNAPSHOT_ENCRYPTION", "off")
    monkeypatch.setenv("PAL_S3_SSE", "aws:kms")
    monkeypatch.setenv("PAL_S3_SSE_KMS_KEY_ID", "alias/pal")
    settings = Settings.from_env(data)
    mirror = S3Mirror.from_settings(settings)
    assert not mirror.encrypts
    assert mirror._sse_args == {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/pal"}
    for name, bad in (("PAL_SNAPSHOT_ENCRYPTION", "maybe"), ("PAL_S3_SSE", "aws:kms:dsse")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            Settings.from_env(data)
        monkeypatch.delenv(name)
