"""What the snapshot store's parts share (store.py composes them): its state, declared
once for the type checker, and the checks every read makes: a meta.json is ours (signed
with this node's key, of the snapshot asked for) and the tenant's."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from pal.errors import BackendError, Unavailable
from pal.snapshots.integrity import (
    check_meta,
    is_signed,
    meta_authentic,
    sign_meta,
)
from pal.snapshots.layout import (
    META_FILE,
    SnapshotRef,
)
from pal.snapshots.local import LocalTier, read_meta_file
from pal.snapshots.s3 import S3Mirror


class MetaNotAuthentic(BackendError):
    """A meta.json that is signed but not by our key, or that describes another snapshot."""


# (agent_version_id, vm_id) -> snapshot ids of that VM retention must keep.
ProtectedProvider = Callable[[str, str], Iterable[str]]


class StoreCore:
    """The state SnapshotStore.__init__ sets, and the helpers of every part."""

    root: Path
    mirror: S3Mirror | None
    log: logging.Logger
    protected_provider: ProtectedProvider | None
    _key: bytes
    _signed_since_ns: int | None
    _clock: Callable[[], float]
    _local: LocalTier
    _lock: threading.Lock
    _download_lock: threading.Lock
    _fork_mem_lock: threading.Lock
    _last_protected: dict[tuple[str, str], set[str]]

    def _seal(self, ref: SnapshotRef) -> dict[str, Any] | None:
        raise NotImplementedError("sealing is the store's own (store.py)")

    def _sign(self, meta: dict[str, Any]) -> dict[str, Any]:
        return sign_meta(meta, self._key)

    def _local_meta(self, snap_dir: Path, ref: SnapshotRef | None) -> dict[str, Any] | None:
        """meta.json of a local snapshot dir; None when absent. MetaNotAuthentic when it is
        signed but the HMAC or its identity is wrong, or unsigned and not from before this
        node signed metas (_unsigned_from_before_signing)."""
        meta = read_meta_file(snap_dir)
        if meta is None:
            return None
        if not is_signed(meta):
            if self._unsigned_from_before_signing(snap_dir):
                return meta
            raise MetaNotAuthentic(f"local snapshot {snap_dir.name} refused: its meta.json is not signed")
        problem = None if meta_authentic(meta, self._key) else "its meta.json is not authentic"
        if problem is None and ref is not None:
            problem = check_meta(meta, ref)
        if problem is not None:
            raise MetaNotAuthentic(f"local snapshot {snap_dir.name} refused: {problem}")
        return meta

    def _unsigned_from_before_signing(self, snap_dir: Path) -> bool:
        """A meta.json without a ``mac`` is one a Pal from before signing wrote, and only
        if its file is older (ctime) than this node's snapshot key: since the key exists,
        every meta this store writes is signed, and any write or replacement of the file
        since would have set its ctime to that moment (no user can set ctime back). A
        store told no key time accepts none."""
        if self._signed_since_ns is None:
            return False
        try:
            return os.stat(snap_dir / META_FILE).st_ctime_ns < self._signed_since_ns
        except OSError:
            return False

    @staticmethod
    def _owned(meta: dict[str, Any], ref: SnapshotRef) -> bool:
        return ref.tenant_id is None or meta.get("tenantId") == ref.tenant_id

    def _s3_call(self, fn: Callable[[S3Mirror], Any]) -> Any:
        assert self.mirror is not None
        try:
            return fn(self.mirror)
        except (BotoCoreError, ClientError, OSError) as exc:
            raise Unavailable(f"snapshot storage (S3) unavailable: {exc}") from exc
