"""Reading snapshots back: meta and ownership, verification, and the restore path
(``locate``: local, else downloaded from S3; ``open_for_restore``: checked before a QEMU
loads it). Part of SnapshotStore (store.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from pal.errors import BackendError, InvalidRequest, NotFound
from pal.snapshots.hashing import hash_files
from pal.snapshots.integrity import (
    FINGERPRINTS_FIELD,
    check_meta,
    fingerprints,
    is_sealed,
    is_signed,
    meta_authentic,
    recorded_fingerprint,
    verify_dir,
)
from pal.snapshots.layout import (
    INLINE_SEAL_MAX_BYTES,
    META_FILE,
    SnapshotRef,
)
from pal.snapshots.local import fsync_path, read_meta_file, write_json_durably
from pal.snapshots.store_core import MetaNotAuthentic, StoreCore


class StoreReads(StoreCore):
    def path(self, ref: SnapshotRef) -> Path:
        return self._local.path(ref)

    def exists(self, ref: SnapshotRef) -> bool:
        """A complete local copy exists (and, if ref names a tenant, belongs to it)."""
        try:
            meta = self._local_meta(self._local.path(ref), ref)
        except MetaNotAuthentic:
            return False
        return meta is not None and self._owned(meta, ref)

    def read_meta(self, ref: SnapshotRef) -> dict[str, Any]:
        """meta of the local copy, else of the S3 copy (authenticated). NotFound if
        neither/not owned; BackendError if the meta is not authentic."""
        meta = self._local_meta(self._local.path(ref), ref)
        if meta is None and self.mirror is not None:
            meta = self._remote_meta(ref)
        if meta is None or not self._owned(meta, ref):
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        return meta

    def owner(self, ref: SnapshotRef) -> str:
        """The tenant a snapshot belongs to (no ownership check on ``ref.tenant_id``)."""
        anon = SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id)
        tenant = self.read_meta(anon).get("tenantId")
        if not isinstance(tenant, str):
            raise BackendError(f"snapshot {ref.snapshot_id} has no tenant in its meta")
        return tenant

    def verify(self, ref_or_path: SnapshotRef | Path, *, allow_unsealed: bool = False) -> bool:
        """The local copy is complete and intact: meta present, every artifact with its
        recorded size and checksum. Accepts a ref or a snapshot dir path.

        An unsealed snapshot of this store is sealed first (``seal_now``), then checked
        in full: a True always means "every checksum matched". With ``allow_unsealed``
        nothing is sealed and an unsealed snapshot passes on structure alone (every
        artifact present with its size, the small artifacts' checksums)."""
        if isinstance(ref_or_path, SnapshotRef):
            ref: SnapshotRef | None = ref_or_path
            snap_dir = self._local.path(ref_or_path)
        else:
            snap_dir = ref_or_path
            ref = self._ref_for(snap_dir)
        try:
            meta = self._local_meta(snap_dir, ref)
        except MetaNotAuthentic as exc:
            self.log.error("%s", exc)
            return False
        if meta is None or (ref is not None and not self._owned(meta, ref)):
            return False
        if not allow_unsealed and not is_sealed(meta) and ref is not None:
            try:
                meta = self._seal(SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id))
            except (BackendError, OSError) as exc:
                self.log.warning("snapshot %s cannot be sealed: %s", ref.snapshot_id, exc)
                return False
            if meta is None:
                return False
        return verify_dir(snap_dir, meta, allow_unsealed=allow_unsealed)

    def _ref_for(self, snap_dir: Path) -> SnapshotRef | None:
        """The ref of a path that is one of this store's snapshot dirs, else None."""
        try:
            parts = snap_dir.resolve().relative_to(self.root.resolve()).parts
        except ValueError:
            return None
        if len(parts) != 3:
            return None
        try:
            return SnapshotRef(*parts)
        except InvalidRequest:
            return None

    def restorable(self, ref: SnapshotRef) -> bool:
        """A resume could load it: the local copy verifies, or there is none and S3 holds a
        sealed copy this store signed (``locate`` downloads it then). A local copy that
        fails its checks is not restorable even if S3 has one: it is what ``locate`` would
        load. BackendError when S3 cannot be read: unknown, not missing."""
        if self.verify(ref):
            return True
        try:
            if self._local_meta(self._local.path(ref), ref) is not None or self.mirror is None:
                return False
        except MetaNotAuthentic:
            return False
        meta = self._remote_meta(ref)
        return meta is not None and self._owned(meta, ref) and is_sealed(meta)

    def locate(self, ref: SnapshotRef) -> Path:
        """Path of a complete local copy; downloads it from S3 first if only S3 has it."""
        local = self._local.path(ref)
        meta = self._local_meta(local, ref)
        if meta is not None:
            if not self._owned(meta, ref):
                raise NotFound(f"snapshot {ref.snapshot_id} not found")
            return local
        if self.mirror is None:
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        with self._download_lock:  # one download per snapshot even when N forks ask at once
            meta = self._local_meta(local, ref)
            if meta is not None:
                if not self._owned(meta, ref):
                    raise NotFound(f"snapshot {ref.snapshot_id} not found")
                return local
            return self._download(ref)

    def _download(self, ref: SnapshotRef) -> Path:
        """Fetch a snapshot only S3 has. Nothing is written before its meta.json is known
        authentic and names only known artifacts; nothing is published before every
        artifact matches its checksum."""
        assert self.mirror is not None
        meta = self._remote_meta(ref)
        if meta is None or not self._owned(meta, ref):
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        if not is_sealed(meta):
            raise BackendError(f"S3 copy of snapshot {ref.snapshot_id} is not sealed")
        staging = self._local.new_staging(ref.snapshot_id)
        try:
            started = time.monotonic()
            self._s3_call(lambda m: m.download(ref, staging, meta))
            big = sorted(n for n, size in meta["sizes"].items() if size > INLINE_SEAL_MAX_BYTES)
            try:
                before = fingerprints(staging, big)
                checked = verify_dir(staging, meta) and fingerprints(staging, big) == before
            except OSError:
                checked = False
            if not checked:
                raise BackendError(f"S3 copy of snapshot {ref.snapshot_id} fails its checksums")
            # The files just checked, as this node's: a restore compares them (not the
            # uploading node's).
            write_json_durably(staging / META_FILE, self._sign({**meta, FINGERPRINTS_FIELD: before}))
            fsync_path(staging)
            with self._lock:
                target = self._local.publish(staging, ref)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.log.info("restored snapshot %s from S3 in %.2fs", ref.snapshot_id, time.monotonic() - started)
        return target

    def _remote_meta(self, ref: SnapshotRef) -> dict[str, Any] | None:
        """meta.json of the S3 copy if there is one: None if absent, BackendError unless it
        is authentic and describes exactly this snapshot (integrity.check_meta)."""
        meta = self._s3_call(lambda m: m.read_meta(ref))
        if meta is None:
            return None
        problem = check_meta(meta, ref)
        if problem is None and not meta_authentic(meta, self._key):
            problem = "its meta.json is not authentic (wrong or missing HMAC)"
        if problem is not None:
            self.log.error("refusing the S3 copy of snapshot %s: %s", ref.snapshot_id, problem)
            raise BackendError(f"S3 copy of snapshot {ref.snapshot_id} refused: {problem}")
        return meta

    def open_for_restore(self, ref: SnapshotRef) -> Path:
        """The local dir of a snapshot about to be restored, checked (docs/security.md,
        "Snapshots"). Its meta must be authentic (signed by this store's key; _local_meta).
        Then:

        - a snapshot not sealed yet (a resume right after its pause, a fork) loads when its
          big artifacts are still the files captured: their fingerprints (inode, size,
          mtime, ctime: no user can set a ctime back) match those its signed meta recorded
          at the commit. A checksum would add nothing here (there is none to compare with
          yet), so the background seal is not waited for. When a fingerprint differs, or
          none was recorded, it is sealed now (hashed) first;
        - a sealed one has its big artifacts' fingerprints compared with those recorded
          at the seal (two ``stat``s); one that differs is re-hashed, and a checksum that
          does not match refuses the restore (BackendError: the VM stays paused);
        - the small artifacts (device state QEMU parses, vmm.json and net.json the manager
          reads) are hashed every time, which costs well under a millisecond.

        A copy from S3 has had every artifact checked on download (and its fingerprints
        recorded then)."""
        path = self.locate(ref)
        anon = SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id)
        meta = self._local_meta(path, ref)
        if meta is None:
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        if not is_sealed(meta) and self._unchanged_since_commit(path, meta):
            pass
        elif not is_sealed(meta):
            try:
                sealed = self._seal(anon)
            except BackendError as exc:
                self.log.error("snapshot %s cannot be verified: %s", ref.snapshot_id, exc)
                raise BackendError(f"snapshot {ref.snapshot_id} is damaged: {exc}") from exc
            if sealed is None:
                raise NotFound(f"snapshot {ref.snapshot_id} not found")
            meta = sealed
        else:
            self._check_big_artifacts(path, anon, meta)
        sizes, digests = meta.get("sizes"), meta.get("sha256")
        if isinstance(sizes, dict) and isinstance(digests, dict):
            small = {
                name: path / name
                for name, size in sizes.items()
                if name in digests and isinstance(size, int) and size <= INLINE_SEAL_MAX_BYTES
            }
            try:
                got = hash_files(small)
            except OSError as exc:
                raise BackendError(f"snapshot {ref.snapshot_id} is damaged: {exc}") from exc
            bad = sorted(n for n, (size, digest) in got.items() if (size, digest) != (sizes[n], digests[n]))
            if bad:
                self.log.error("snapshot %s: %s do not match their checksums", ref.snapshot_id, bad)
                raise BackendError(f"snapshot {ref.snapshot_id} is damaged: {bad} fail their checksums")
        return path

    @staticmethod
    def _unchanged_since_commit(path: Path, meta: dict[str, Any]) -> bool:
        """Every big artifact of an unsealed snapshot is the file committed (its signed
        meta's fingerprint)."""
        sizes = meta.get("sizes")
        if not is_signed(meta) or not isinstance(sizes, dict):
            return False
        big = sorted(n for n, size in sizes.items() if isinstance(size, int) and size > INLINE_SEAL_MAX_BYTES)
        try:
            now = fingerprints(path, big)
        except OSError:
            return False
        return all(recorded_fingerprint(meta, n) == now[n] for n in big)

    def _check_big_artifacts(self, path: Path, ref: SnapshotRef, meta: dict[str, Any]) -> None:
        """A sealed snapshot's big artifacts are the files sealed (fingerprints), or hash
        to their checksums (then their fingerprints are recorded again, so the next
        restore is cheap). BackendError when one does not."""
        sizes, digests = meta["sizes"], meta["sha256"]
        big = sorted(n for n, size in sizes.items() if size > INLINE_SEAL_MAX_BYTES)
        try:
            now = fingerprints(path, big)
        except OSError as exc:
            raise BackendError(f"snapshot {ref.snapshot_id} is damaged: {exc}") from exc
        # An unsigned meta (from before signing) vouches for no fingerprint: hash them all.
        stale = [n for n in big if not is_signed(meta) or recorded_fingerprint(meta, n) != now[n]]
        if not stale:
            return
        started = time.monotonic()
        try:
            hashed = hash_files({n: path / n for n in stale})
            after = fingerprints(path, stale)
        except OSError as exc:
            raise BackendError(f"snapshot {ref.snapshot_id} is damaged: {exc}") from exc
        bad = sorted(n for n in stale if hashed[n] != (sizes[n], digests[n]))
        if bad:
            self.log.error("snapshot %s: %s changed since the seal, checksums fail", ref.snapshot_id, bad)
            raise BackendError(f"snapshot {ref.snapshot_id} is damaged: {bad} fail their checksums")
        self.log.info(
            "snapshot %s: %s touched since the seal, checksums still match (%.0f ms)",
            ref.snapshot_id,
            stale,
            (time.monotonic() - started) * 1000,
        )
        if all(after[n] == now[n] for n in stale):  # not changing under us: record them
            self._record_fingerprints(path, meta, after)

    def _record_fingerprints(self, snap_dir: Path, meta: dict[str, Any], fps: dict[str, list[int]]) -> None:
        """Rewrite a verified meta with the artifacts' current fingerprints (best effort:
        only if the meta is still the one verified)."""
        old = meta.get(FINGERPRINTS_FIELD)
        updated = self._sign({**meta, FINGERPRINTS_FIELD: {**(old if isinstance(old, dict) else {}), **fps}})
        try:
            with self._lock:
                if read_meta_file(snap_dir) != meta:
                    return
                write_json_durably(snap_dir / META_FILE, updated)
                fsync_path(snap_dir)
        except OSError as exc:
            self.log.warning("could not record the fingerprints of %s: %s", snap_dir.name, exc)
