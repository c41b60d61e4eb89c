"""A meta.json from S3 is untrusted input: an oversized, malformed or absurdly nested one
is refused with the same clear error as a forged one, never a 500 from a parser or a
large allocation. The bucket is a stub client that answers what a hostile bucket would."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from pal.errors import BackendError
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.s3 import MAX_META_BYTES, S3Mirror
from pal.snapshots.store import SnapshotStore

AV = "default-0123456789ab"
REF = SnapshotRef(AV, "vm-1", "snap-1", "t1")


class CountingBody(io.BytesIO):
    """An S3 response body that remembers how much was read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.taken = 0

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.taken += len(chunk)
        return chunk


class HostileBucket:
    """The few client calls read_meta makes, answering ``body`` for every object."""

    def __init__(self, body: bytes) -> None:
        self.data = body
        self.body = CountingBody(body)

    def head_bucket(self, **_: Any) -> dict[str, Any]:
        return {}

    def get_object(self, **_: Any) -> dict[str, Any]:
        self.body = CountingBody(self.data)  # each GET streams the object afresh
        return {"Body": self.body, "ContentLength": len(self.data)}


def mirror_serving(body: bytes) -> tuple[S3Mirror, HostileBucket]:
    mirror = S3Mirror("http://127.0.0.1:9", "pal-hostile")
    bucket = HostileBucket(body)
    mirror._client = bucket  # type: ignore[assignment]
    return mirror, bucket


HOSTILE = {
    "oversized": b'{"pad": "' + b"x" * (MAX_META_BYTES + 10) + b'"}',
    "not json": b"\x00\xffnot json at all",
    "bad utf-8": b'{"tenantId": "\xff\xfe"}',
    "nested deeply": b"[" * 200_000 + b"]" * 200_000,
    "truncated": b'{"tenantId": "t1", "sizes": {',
    "a list": b"[1, 2, 3]",
}


@pytest.mark.parametrize("body", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_meta_is_refused_clearly(body: bytes) -> None:
    mirror, bucket = mirror_serving(body)
    with pytest.raises(BackendError, match="S3 copy of snapshot snap-1 refused") as info:
        mirror.read_meta(REF)
    assert info.value.status == 500 and "Traceback" not in info.value.message
    assert bucket.body.taken <= MAX_META_BYTES + 1, "never read past the cap"


def test_an_oversized_meta_is_not_read_into_memory() -> None:
    mirror, bucket = mirror_serving(b"{" + b" " * (64 * MAX_META_BYTES) + b"}")
    with pytest.raises(BackendError, match="larger than"):
        mirror.read_meta(REF)
    assert bucket.body.taken == MAX_META_BYTES + 1


def test_a_meta_just_under_the_cap_is_read() -> None:
    meta = {"tenantId": "t1", "pad": ""}
    meta["pad"] = "x" * (MAX_META_BYTES - len(json.dumps(meta)))
    body = json.dumps(meta).encode()
    assert len(body) == MAX_META_BYTES
    mirror, _ = mirror_serving(body)
    assert mirror.read_meta(REF) == meta


def test_the_store_answers_a_hostile_bucket_with_the_refusal(tmp_path: Path) -> None:
    """Through the store (what a resume on another node calls): the clear refusal, no
    ValueError or RecursionError escaping to the API as a bare 500."""
    store = SnapshotStore(tmp_path / "snapshots", None, key=b"k" * 32)
    mirror, _ = mirror_serving(HOSTILE["nested deeply"])
    store.mirror = mirror
    try:
        for call in (store.read_meta, store.locate):
            with pytest.raises(BackendError, match=r"refused: its meta\.json is not valid JSON"):
                call(REF)
    finally:
        store.close()
