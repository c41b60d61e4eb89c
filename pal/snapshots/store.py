"""SnapshotStore: the one object the runtime manager uses for snapshots.

Local tier first (canonical copy), optional S3 mirror behind it, retention after every
commit on both tiers, and tenant ownership: a snapshot belongs to the tenant named in its
meta, and asking for it as another tenant is NotFound (spec: ADR 0025).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from pal.config import Settings
from pal.errors import BackendError, Conflict, InvalidRequest, NotFound, Unavailable
from pal.snapshots import retention
from pal.snapshots.hashing import HASH_ALGO, hash_files
from pal.snapshots.layout import (
    ARTIFACTS,
    META_FILE,
    REQUIRED_ARTIFACTS,
    S3_QUEUE_DIRNAME,
    SnapshotRef,
    validate_id,
)
from pal.snapshots.local import LocalTier, fsync_path, read_meta_file, write_json_durably
from pal.snapshots.s3 import S3Mirror

# (agent_version_id, vm_id) -> snapshot ids of that VM retention must keep.
ProtectedProvider = Callable[[str, str], Iterable[str]]


class SnapshotStore:
    def __init__(
        self,
        root: Path,
        mirror: S3Mirror | None = None,
        log: logging.Logger | None = None,
        *,
        protected_provider: ProtectedProvider | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.mirror = mirror
        self.log = log or logging.getLogger("pal.snapshots")
        # Commit runs retention only when it can ask what is protected: deleting the
        # snapshot a paused VM resumes from would lose the VM, keeping one more is cheap.
        self.protected_provider = protected_provider
        self._clock = clock
        self._local = LocalTier(root)
        self._lock = threading.Lock()  # serialises publish / delete / retention
        self._download_lock = threading.Lock()  # one S3 download at a time, outside _lock
        if mirror is not None:
            mirror.start(root / S3_QUEUE_DIRNAME, self._local)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        log: logging.Logger | None = None,
        *,
        protected_provider: ProtectedProvider | None = None,
    ) -> SnapshotStore:
        """The store at SNAPSHOT_DIR, mirrored to S3 when S3_ENDPOINT and S3_BUCKET are set."""
        mirror = None
        if settings.s3_enabled:
            assert settings.s3_bucket is not None
            mirror = S3Mirror(settings.s3_endpoint, settings.s3_bucket, settings.s3_region, log)
        return cls(settings.snapshots_root, mirror, log, protected_provider=protected_provider)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the mirror's worker; pending uploads stay queued on disk for next start."""
        if self.mirror is not None:
            self.mirror.stop(timeout)

    # -- writing ----------------------------------------------------------------------

    def staging_dir(self, snapshot_id: str) -> Path:
        """A new empty dir for the VMM to write artifacts into (root/.staging/<id>.<rand>)."""
        return self._local.new_staging(validate_id(snapshot_id, "snapshot_id"))

    def cleanup_staging(self, older_than_s: float = 0.0) -> list[str]:
        """Remove leftovers of interrupted commits/downloads/deletes. Call at startup."""
        removed = self._local.cleanup_staging(older_than_s)
        if removed:
            self.log.info("removed %d leftover staging dir(s): %s", len(removed), removed)
        return removed

    def commit(self, staging: Path, ref: SnapshotRef, meta: dict[str, Any]) -> Path:
        """Checksum the artifacts in ``staging``, write meta.json, fsync, and rename the
        whole dir into place; then queue the S3 upload and run retention.

        ``meta`` carries what only the caller knows (parentSnapshotId, qemuVersion,
        kernelVersion, memory "file"|"stream", ...); identity, sizes, checksums and
        createdAt are filled in here. ``ref.tenant_id`` is required: it is the owner.
        """
        started = time.monotonic()
        if ref.tenant_id is None:
            raise InvalidRequest("commit needs the owning tenant_id")
        if not staging.is_dir() or not self._local.is_staging(staging):
            raise InvalidRequest(f"{staging} is not a staging dir of this store")
        names = {p.name for p in staging.iterdir()}
        unknown = names - set(ARTIFACTS)
        if unknown:
            raise InvalidRequest(f"unexpected files in snapshot staging dir: {sorted(unknown)}")
        missing = REQUIRED_ARTIFACTS - names
        if missing:
            raise InvalidRequest(f"snapshot staging dir lacks {sorted(missing)}")
        if (self._local.path(ref) / META_FILE).exists():
            raise Conflict(f"snapshot {ref.snapshot_id} already exists")

        artifacts = {name: staging / name for name in ARTIFACTS if name in names}
        hashed = hash_files(artifacts, fsync=True)
        hashed_at = time.monotonic()
        full_meta = dict(meta)
        full_meta.update(
            {
                "snapshotId": ref.snapshot_id,
                "agentVersionId": ref.agent_version_id,
                "vmId": ref.vm_id,
                "tenantId": ref.tenant_id,
                "parentSnapshotId": meta.get("parentSnapshotId"),
                "createdAt": datetime.fromtimestamp(self._clock(), UTC).isoformat().replace("+00:00", "Z"),
                "hashAlgo": HASH_ALGO,
                "artifacts": sorted(artifacts),
                "sizes": {name: size for name, (size, _) in hashed.items()},
                "sha256": {name: digest for name, (_, digest) in hashed.items()},
            }
        )
        write_json_durably(staging / META_FILE, full_meta)
        fsync_path(staging)
        with self._lock:
            try:
                target = self._local.publish(staging, ref)
            except FileExistsError:
                raise Conflict(f"snapshot {ref.snapshot_id} already exists") from None
        self.log.info(
            "committed snapshot %s/%s/%s (%s) hash+fsync %.0f ms, total %.0f ms",
            ref.agent_version_id,
            ref.vm_id,
            ref.snapshot_id,
            full_meta["sizes"],
            (hashed_at - started) * 1000,
            (time.monotonic() - started) * 1000,
        )
        if self.mirror is not None:
            try:
                self.mirror.schedule_upload(ref)
            except Exception:
                # Never fail a pause for the mirror; the local copy is complete.
                self.log.exception("could not queue the S3 upload of %s", ref.snapshot_id)
        if self.protected_provider is not None:
            try:
                protected = set(self.protected_provider(ref.agent_version_id, ref.vm_id))
                protected.add(ref.snapshot_id)
                self.apply_retention(ref.agent_version_id, ref.vm_id, protected)
            except Exception:
                # The snapshot is safe; retention runs again after the next write.
                self.log.exception("retention after commit of %s failed", ref.snapshot_id)
        return target

    # -- reading ----------------------------------------------------------------------

    def path(self, ref: SnapshotRef) -> Path:
        return self._local.path(ref)

    def exists(self, ref: SnapshotRef) -> bool:
        """A complete local copy exists (and, if ref names a tenant, belongs to it)."""
        meta = read_meta_file(self._local.path(ref))
        return meta is not None and self._owned(meta, ref)

    def read_meta(self, ref: SnapshotRef) -> dict[str, Any]:
        """meta of the local copy, else of the S3 copy. NotFound if neither/not owned."""
        meta = read_meta_file(self._local.path(ref))
        if meta is None and self.mirror is not None:
            meta = self._s3_call(lambda m: m.read_meta(ref))
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

    def check_owner(self, ref: SnapshotRef) -> None:
        """Raise NotFound unless the snapshot exists and belongs to ``ref.tenant_id``."""
        self.read_meta(ref)

    def verify(self, ref_or_path: SnapshotRef | Path) -> bool:
        """The local copy is complete: meta present, every artifact's size and checksum
        match. Accepts a ref or a snapshot dir path."""
        if isinstance(ref_or_path, SnapshotRef):
            meta = read_meta_file(self._local.path(ref_or_path))
            if meta is not None and not self._owned(meta, ref_or_path):
                return False
            snap_dir = self._local.path(ref_or_path)
        else:
            snap_dir = ref_or_path
            meta = read_meta_file(snap_dir)
        return meta is not None and _verify_dir(snap_dir, meta)

    def locate(self, ref: SnapshotRef) -> Path:
        """Path of a complete local copy; downloads it from S3 first if only S3 has it."""
        local = self._local.path(ref)
        meta = read_meta_file(local)
        if meta is not None:
            if not self._owned(meta, ref):
                raise NotFound(f"snapshot {ref.snapshot_id} not found")
            return local
        if self.mirror is None:
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        with self._download_lock:  # one download per snapshot even when N forks ask at once
            meta = read_meta_file(local)
            if meta is not None:
                if not self._owned(meta, ref):
                    raise NotFound(f"snapshot {ref.snapshot_id} not found")
                return local
            return self._download(ref)

    def _download(self, ref: SnapshotRef) -> Path:
        assert self.mirror is not None
        meta = self._s3_call(lambda m: m.read_meta(ref))
        if meta is None or not self._owned(meta, ref):
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        staging = self._local.new_staging(ref.snapshot_id)
        try:
            started = time.monotonic()
            self._s3_call(lambda m: m.download(ref, staging, meta))
            if not _verify_dir(staging, meta):
                raise BackendError(f"S3 copy of snapshot {ref.snapshot_id} fails its checksums")
            fsync_path(staging)
            with self._lock:
                target = self._local.publish(staging, ref)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.log.info("restored snapshot %s from S3 in %.2fs", ref.snapshot_id, time.monotonic() - started)
        return target

    def list_vm(
        self, agent_version_id: str, vm_id: str, tenant_id: str | None = None
    ) -> list[dict[str, Any]]:
        """Metas of one VM's complete local snapshots, oldest first (optionally one tenant's)."""
        metas = self._local.list_vm(agent_version_id, vm_id)
        if tenant_id is not None:
            metas = [m for m in metas if m.get("tenantId") == tenant_id]
        return sorted(metas, key=lambda m: (retention.created_unix(m) or 0.0, str(m.get("snapshotId"))))

    # -- deleting ---------------------------------------------------------------------

    def delete(self, ref: SnapshotRef) -> None:
        """Delete on both tiers (S3 in the background, retried). Idempotent, but another
        tenant's snapshot is NotFound."""
        if ref.tenant_id is not None:
            meta = read_meta_file(self._local.path(ref))
            if meta is not None and not self._owned(meta, ref):
                raise NotFound(f"snapshot {ref.snapshot_id} not found")
        with self._lock:
            removed = self._local.remove(ref)
        if removed:
            self.log.info("deleted local snapshot %s", ref.snapshot_id)
        if self.mirror is not None:
            self.mirror.schedule_delete(SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id))

    def apply_retention(self, agent_version_id: str, vm_id: str, protected: set[str]) -> list[str]:
        """Apply retention to one VM's snapshots: local now, S3 in the background.
        Returns the ids deleted locally."""
        with self._lock:
            metas = self._local.list_vm(agent_version_id, vm_id)
            now = self._clock()
            doomed = retention.to_delete(retention.ages_from_metas(metas, now), protected, now)
            for snapshot_id in doomed:
                self._local.remove(SnapshotRef(agent_version_id, vm_id, snapshot_id))
        if doomed:
            self.log.info(
                "retention for %s/%s deleted %s (protected %s)",
                agent_version_id,
                vm_id,
                doomed,
                sorted(protected),
            )
        if self.mirror is not None:
            self.mirror.schedule_retention(agent_version_id, vm_id, protected)
        return doomed

    # -- helpers ----------------------------------------------------------------------

    @staticmethod
    def _owned(meta: dict[str, Any], ref: SnapshotRef) -> bool:
        return ref.tenant_id is None or meta.get("tenantId") == ref.tenant_id

    def _s3_call(self, fn: Callable[[S3Mirror], Any]) -> Any:
        assert self.mirror is not None
        try:
            return fn(self.mirror)
        except (BotoCoreError, ClientError, OSError) as exc:
            raise Unavailable(f"snapshot storage (S3) unavailable: {exc}") from exc


def _verify_dir(snap_dir: Path, meta: dict[str, Any]) -> bool:
    sizes = meta.get("sizes")
    digests = meta.get("sha256")
    if meta.get("hashAlgo") != HASH_ALGO or not isinstance(sizes, dict) or not isinstance(digests, dict):
        return False
    if set(sizes) != set(digests) or not REQUIRED_ARTIFACTS <= set(sizes):
        return False
    paths = {name: snap_dir / name for name in sizes}
    for name, path in paths.items():
        try:
            if os.stat(path).st_size != sizes[name]:
                return False
        except OSError:
            return False
    try:
        hashed = hash_files(paths)
    except OSError:
        return False
    return all(hashed[name] == (sizes[name], digests[name]) for name in paths)
