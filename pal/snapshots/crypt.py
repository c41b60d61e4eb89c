"""Snapshots encrypted before they leave the node for S3: ``pal-enc-v1``.

Guest RAM holds plaintext secrets, and whoever can read the bucket (a cloud node's
instance role usually can read all of it) must not read them. So every artifact object a
node uploads is encrypted on the node, and the bucket holds no key that opens it.

Keys. Each upload of a snapshot draws a random 256-bit *data key*. It travels in the
snapshot's ``key.json`` object, wrapped (AES-256-GCM) under the *snapshot encryption key*
(``PAL_SNAPSHOT_ENCRYPTION_KEY_FILE``: 32 bytes that every node of a bucket shares, never
uploaded), with the snapshot's identity as associated data, so a ``key.json`` copied to
another snapshot does not open. ``key.json`` names the encryption key by its id (a hash,
:func:`key_id`), so a node holding another key says so instead of "corrupt". Rotating the
encryption key rewraps the data keys, i.e. rewrites only the ``key.json`` objects
(:func:`rewrap`, ``pal snapshots rekey``), never the data.

Objects. An artifact object is its ``pal-sparse-v1`` stream (layout.py: holes are not
stored) cut into chunks of ``chunk_bytes`` plaintext bytes, each sealed with AES-256-GCM
under a key derived (HKDF-SHA256) from the data key and the artifact's identity::

    header  b"PALENC01" + u32 chunk_bytes                               (12 bytes)
    chunk*  AES-GCM(chunk_bytes of plaintext) + 16-byte tag; the last chunk holds the
            rest (0..chunk_bytes bytes) and is the only one sealed with last = 1

    nonce(i) = u64 i + u32 last
    aad(i)   = header + identity + u64 i + u8 last
    identity = "<agent_version_id>/<vm_id>/<snapshot_id>/<artifact>"

Integers are big-endian. A chunk moved within the object (its index), to another artifact
or snapshot (identity, and another derived key), a truncation at a chunk boundary (no
chunk sealed as last) and bytes after the last chunk all fail to authenticate. Every
chunk but the last has the same size, so chunk ``i`` lies at a computable byte range
(:func:`chunk_span`) and opens on its own (:func:`open_chunk`): a reader may fetch any
part of an object with a ranged GET.

What stays in the clear: ``meta.json`` (HMAC-authenticated, integrity.py): ids, tenant,
sizes, times, versions, the artifacts' sha256. Not the data. The local tier is not
encrypted (the node's own 0700 root-only disk, where restores map the files directly).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pal.errors import BackendError
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.upload_stream import UploadStream

SCHEME = "pal-enc-v1"
KEY_FORMAT = "pal-snapshot-key-v1"
MAGIC = b"PALENC01"
CHUNK_BYTES = 1 << 20
# Readers accept what a writer could have chosen, no more: bounds the memory one chunk takes.
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4 << 10, 16 << 20
TAG_BYTES = 16
DATA_KEY_BYTES = 32
# A key.json is ~200 bytes: anything bigger is not ours and is not read or parsed.
MAX_KEY_OBJECT_BYTES = 4096
_HEADER = struct.Struct(">8sI")
HEADER_BYTES = _HEADER.size
_NONCE = struct.Struct(">QI")
_AAD_TAIL = struct.Struct(">QB")


def read_full(read: Callable[[int], bytes], n: int) -> bytes:
    """``n`` bytes from ``read``, or fewer only at its end (a read may return less)."""
    parts, left = [], n
    while left:
        got = read(left)
        if not got:
            break
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


class SnapshotUnreadable(BackendError):
    """An encrypted S3 object or key.json that does not open: tampered with, truncated,
    moved from another snapshot, or sealed under another encryption key."""


def key_id(key: bytes) -> str:
    """A name for an encryption key that does not reveal it (recorded in key.json)."""
    return hashlib.sha256(b"pal-snapshot-encryption-key-id\0" + key).hexdigest()[:16]


def snapshot_identity(ref: SnapshotRef) -> str:
    return f"{ref.agent_version_id}/{ref.vm_id}/{ref.snapshot_id}"


def artifact_identity(ref: SnapshotRef, artifact: str) -> bytes:
    return f"{snapshot_identity(ref)}/{artifact}".encode()


def new_data_key() -> bytes:
    return os.urandom(DATA_KEY_BYTES)


# -- key.json: the data key, wrapped ---------------------------------------------------


def _wrap_aad(ref: SnapshotRef, kid: str) -> bytes:
    return f"{KEY_FORMAT}\0{snapshot_identity(ref)}\0{kid}".encode()


def wrap(data_key: bytes, encryption_key: bytes, ref: SnapshotRef) -> bytes:
    """The ``key.json`` body holding ``data_key`` for snapshot ``ref``."""
    kid = key_id(encryption_key)
    nonce = os.urandom(12)
    sealed = AESGCM(encryption_key).encrypt(nonce, data_key, _wrap_aad(ref, kid))
    body = {
        "format": KEY_FORMAT,
        "snapshot": snapshot_identity(ref),
        "keyId": kid,
        "nonce": base64.b64encode(nonce).decode(),
        "wrappedKey": base64.b64encode(sealed).decode(),
    }
    return (json.dumps(body, sort_keys=True) + "\n").encode()


def wrapped_key_id(body: bytes, ref: SnapshotRef) -> str:
    """The id of the encryption key a ``key.json`` body is wrapped under."""
    return _parse_key_object(body, ref)[0]


def _parse_key_object(body: bytes, ref: SnapshotRef) -> tuple[str, bytes, bytes]:
    where = f"the key.json of snapshot {ref.snapshot_id}"
    if len(body) > MAX_KEY_OBJECT_BYTES:
        raise SnapshotUnreadable(f"{where} is larger than {MAX_KEY_OBJECT_BYTES} bytes")
    try:
        data: Any = json.loads(body)
        if not isinstance(data, dict) or data.get("format") != KEY_FORMAT:
            raise ValueError("not a key object")
        kid, nonce_b64, sealed_b64 = data["keyId"], data["nonce"], data["wrappedKey"]
        if not all(isinstance(v, str) for v in (kid, nonce_b64, sealed_b64)):
            raise ValueError("fields are not strings")
        nonce = base64.b64decode(nonce_b64, validate=True)
        sealed = base64.b64decode(sealed_b64, validate=True)
    except (ValueError, KeyError, RecursionError, binascii.Error):
        raise SnapshotUnreadable(f"{where} is malformed") from None
    return kid, nonce, sealed


def unwrap(body: bytes, encryption_key: bytes, ref: SnapshotRef) -> bytes:
    """The data key in a ``key.json`` body. SnapshotUnreadable, saying which, when it is
    wrapped under another encryption key, or does not open (tampered, another snapshot's)."""
    kid, nonce, sealed = _parse_key_object(body, ref)
    mine = key_id(encryption_key)
    if kid != mine:
        raise SnapshotUnreadable(
            f"the S3 copy of snapshot {ref.snapshot_id} is encrypted under snapshot encryption key"
            f" {kid}, and this node holds key {mine} (PAL_SNAPSHOT_ENCRYPTION_KEY_FILE must be the"
            " same file on every node of the bucket; after a rotation, the new one)"
        )
    try:
        data_key = AESGCM(encryption_key).decrypt(nonce, sealed, _wrap_aad(ref, kid))
    except (InvalidTag, ValueError):
        raise SnapshotUnreadable(
            f"the data key of snapshot {ref.snapshot_id} does not open: its key.json was tampered"
            " with or belongs to another snapshot"
        ) from None
    if len(data_key) != DATA_KEY_BYTES:
        raise SnapshotUnreadable(f"the data key of snapshot {ref.snapshot_id} has the wrong length")
    return data_key


def rewrap(body: bytes, old_key: bytes, new_key: bytes, ref: SnapshotRef) -> bytes:
    """The ``key.json`` body with the same data key, wrapped under ``new_key`` instead."""
    return wrap(unwrap(body, old_key, ref), new_key, ref)


# -- chunked AEAD stream ---------------------------------------------------------------


def _artifact_aead(data_key: bytes, identity: bytes) -> AESGCM:
    derived = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"pal-enc-v1 artifact\0" + identity
    ).derive(data_key)
    return AESGCM(derived)


def _nonce_aad(header: bytes, identity: bytes, index: int, last: bool) -> tuple[bytes, bytes]:
    return _NONCE.pack(index, int(last)), header + identity + _AAD_TAIL.pack(index, int(last))


def chunk_span(index: int, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, int]:
    """The byte range [start, end) of chunk ``index`` in an object (the last chunk may end
    sooner): what a ranged GET fetches to open that chunk alone."""
    start = HEADER_BYTES + index * (chunk_bytes + TAG_BYTES)
    return start, start + chunk_bytes + TAG_BYTES


def parse_header(header: bytes) -> int:
    """The chunk size an object's header declares; SnapshotUnreadable if it is not ours."""
    if len(header) != HEADER_BYTES:
        raise SnapshotUnreadable("encrypted object truncated in its header")
    magic, chunk_bytes = _HEADER.unpack(header)
    if magic != MAGIC or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise SnapshotUnreadable(f"not a {SCHEME} object (bad header)")
    return int(chunk_bytes)


def open_chunk(
    data_key: bytes, identity: bytes, header: bytes, index: int, sealed: bytes, *, last: bool
) -> bytes:
    """The plaintext of one chunk (e.g. fetched by a ranged GET: :func:`chunk_span`)."""
    parse_header(header)
    return _open(_artifact_aead(data_key, identity), header, identity, index, sealed, last)


def _open(aead: AESGCM, header: bytes, identity: bytes, index: int, sealed: bytes, last: bool) -> bytes:
    nonce, aad = _nonce_aad(header, identity, index, last)
    try:
        return aead.decrypt(nonce, sealed, aad)
    except InvalidTag:
        raise SnapshotUnreadable(
            f"chunk {index} of {identity.decode(errors='replace')} does not authenticate: the object"
            " was tampered with, truncated, or holds another snapshot's data"
        ) from None


class EncryptingReader(UploadStream):
    """A read-only, non-seekable file object: the ``pal-enc-v1`` object of the plaintext
    that ``read(n)`` returns (for boto3's ``upload_fileobj``). Constant memory."""

    def __init__(
        self, read: Callable[[int], bytes], data_key: bytes, identity: bytes, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        super().__init__()
        self._source = read
        self._aead = _artifact_aead(data_key, identity)
        self._identity = identity
        self._chunk_bytes = chunk_bytes
        self._header = _HEADER.pack(MAGIC, chunk_bytes)
        self._pieces = self._generate()
        self._cur = b""  # the piece being read out, from _pos
        self._pos = 0
        self.bytes_out = 0

    def _fill(self, n: int) -> bytes:
        return read_full(self._source, n)

    def _generate(self) -> Iterator[bytes]:
        yield self._header
        index = 0
        current = self._fill(self._chunk_bytes)
        while True:
            # One chunk of lookahead: a chunk is sealed as last only when nothing follows.
            following = self._fill(self._chunk_bytes) if len(current) == self._chunk_bytes else b""
            last = not following
            nonce, aad = _nonce_aad(self._header, self._identity, index, last)
            yield self._aead.encrypt(nonce, current, aad)
            if last:
                return
            current, index = following, index + 1

    def read(self, size: int | None = -1) -> bytes:
        # Whole pieces are handed on as they are: no buffer that grows and shrinks (that
        # copying, not AES, was what bounded the throughput).
        want = None if size is None or size < 0 else size
        parts: list[bytes] = []
        got = 0
        while want is None or got < want:
            if self._pos >= len(self._cur):
                piece = next(self._pieces, None)
                if piece is None:
                    break
                self._cur, self._pos = piece, 0
                continue
            take = len(self._cur) - self._pos if want is None else min(want - got, len(self._cur) - self._pos)
            parts.append(self._cur if take == len(self._cur) else self._cur[self._pos : self._pos + take])
            self._pos += take
            got += take
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        self.bytes_out += len(out)
        return out


class DecryptingReader:
    """``read(n)`` over the plaintext of a ``pal-enc-v1`` object that ``read(n)`` of the
    ciphertext returns; every chunk is authenticated before any of its bytes is returned,
    and the end of the object must be the chunk sealed as last (SnapshotUnreadable)."""

    def __init__(self, read: Callable[[int], bytes], data_key: bytes, identity: bytes) -> None:
        self._source = read
        self._identity = identity
        self._header = self._fill(HEADER_BYTES)
        self._sealed_bytes = parse_header(self._header) + TAG_BYTES
        self._aead = _artifact_aead(data_key, identity)
        self._index = 0
        self._pending = self._fill(self._sealed_bytes)
        self._plain = b""
        self._pos = 0
        self._ended = False

    def _fill(self, n: int) -> bytes:
        return read_full(self._source, n)

    def _next_chunk(self) -> None:
        sealed = self._pending
        if len(sealed) < TAG_BYTES:
            raise SnapshotUnreadable(
                f"{self._identity.decode(errors='replace')} is truncated (chunk {self._index} is missing)"
            )
        following = self._fill(self._sealed_bytes) if len(sealed) == self._sealed_bytes else b""
        last = not following
        self._plain = _open(self._aead, self._header, self._identity, self._index, sealed, last)
        self._pos = 0
        self._pending = following
        self._index += 1
        self._ended = last

    def read(self, n: int) -> bytes:
        while self._pos >= len(self._plain):
            if self._ended:
                return b""
            self._next_chunk()
        out = self._plain[self._pos : self._pos + n]
        self._pos += len(out)
        return out
