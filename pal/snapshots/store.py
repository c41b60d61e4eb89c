"""SnapshotStore: the one object the runtime manager uses for snapshots.

Local tier first (canonical copy), optional S3 mirror behind it, retention after every
commit on both tiers, and tenant ownership: a snapshot belongs to the tenant named in its
meta, and asking for it as another tenant is NotFound (spec: ADR 0025).

Sealing in the background. A pause waits for ``commit``, and checksumming + fsyncing a
VM's mem and rootfs (hundreds of MB of data) costs more than the whole pause budget. So
``commit`` checksums and fsyncs only the small artifacts (<= INLINE_SEAL_MAX_BYTES: device
state, vmm.json), records every artifact's size, writes meta.json with ``"sealed": false``,
fsyncs it and the dirs, and publishes the dir with one rename. A *seal job* (persisted in
``.seal-queue/`` before the rename, so a restart re-runs it) then checksums and fsyncs the
big artifacts, rewrites meta.json atomically with their sha256 and ``"sealed": true``, and
only then queues the S3 upload: S3 only ever holds sealed snapshots.

Why this is safe, and where it is not:
- Process crashes (kill -9, OOM, a manager bug) are the crash model we guarantee. Written
  data is in the kernel page cache the moment ``write``/reflink returns, so it survives
  the process; the staging dir + rename keep a snapshot all-or-nothing. An unsealed
  snapshot after such a crash is exactly as good as a sealed one, and the restarted store
  seals it.
- Power loss / kernel crash within the seal window (commit -> seal done: measured 0.4-2 s
  for a 256 MiB mem + 2 GiB rootfs pair with 280 MB of data on these shared 2-core hosts,
  mostly reading the fresh reflinks, longer with a backlog): the big artifacts were not fsynced
  yet, so their blocks may be lost while the fsynced meta.json still lists them with the
  right sizes. After reboot such a snapshot cannot be told apart from a good one: the
  re-seal would checksum whatever is on disk, damaged or not. This is a known, accepted
  limitation of the window. Once sealed, the big files are fsynced (durable) and their
  checksums detect any later corruption.
- A seal job tolerates its snapshot being deleted (retention, delete) before or while it
  runs: it then drops itself and never recreates anything.

``locate`` returns unsealed snapshots (resume right after a pause must not wait for the
seal). ``verify(ref)`` of an unsealed snapshot seals it first (``seal_now``) and then
checks every checksum, so reconciliation (which calls ``verify`` through the manager's
snapshot status) never trusts an unchecked snapshot; ``verify(..., allow_unsealed=True)``
is the cheap structural check (meta, every artifact present with its recorded size, the
small artifacts' checksums) without sealing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pal import keyfile
from pal.config import Settings
from pal.errors import BackendError, Conflict, InvalidRequest, NotFound, Unavailable
from pal.ids import validate_id
from pal.snapshots.hashing import HASH_ALGO, hash_files
from pal.snapshots.integrity import (
    FINGERPRINTS_FIELD,
    fingerprints,
    is_sealed,
    recorded_fingerprint,
    unsealed_artifacts,
)
from pal.snapshots.jobqueue import DropJob, JobQueue
from pal.snapshots.layout import (
    ARTIFACTS,
    INLINE_SEAL_MAX_BYTES,
    META_FILE,
    REQUIRED_ARTIFACTS,
    S3_QUEUE_DIRNAME,
    SEAL_QUEUE_DIRNAME,
    SnapshotRef,
)
from pal.snapshots.local import LocalTier, fsync_path, read_meta_file, write_json_durably
from pal.snapshots.s3 import S3Mirror
from pal.snapshots.store_books import StoreBooks
from pal.snapshots.store_core import ProtectedProvider
from pal.snapshots.store_reads import StoreReads


class SnapshotStore(StoreReads, StoreBooks):
    def __init__(
        self,
        root: Path,
        mirror: S3Mirror | None = None,
        log: logging.Logger | None = None,
        *,
        key: bytes,
        protected_provider: ProtectedProvider | None = None,
        clock: Callable[[], float] = time.time,
        seal_retry_base_s: float = 1.0,
        signed_since_ns: int | None = None,
    ) -> None:
        """``key``: the snapshot HMAC key (``Settings.snapshot_key_path``) every meta.json
        is signed with and checked against; nodes sharing an S3 bucket share it.
        ``signed_since_ns``: when this node got its key (the key file's mtime): a meta.json
        without a ``mac`` is accepted only if it is older than that (_local_meta)."""
        self.root = root
        self.mirror = mirror
        self._key = key
        self._signed_since_ns = signed_since_ns
        self.log = log or logging.getLogger("pal.snapshots")
        # Commit runs retention only when it can ask what is protected: deleting the
        # snapshot a paused VM resumes from would lose the VM, keeping one more is cheap.
        self.protected_provider = protected_provider
        self._clock = clock
        self._local = LocalTier(root)
        self._lock = threading.Lock()  # serialises publish / delete / retention
        self._download_lock = threading.Lock()  # one S3 download at a time, outside _lock
        self._fork_mem_lock = threading.Lock()
        # One seal at a time (worker or seal_now): two hashing the same files would only
        # waste I/O, and the worker's seal of the next snapshot can wait ~0.2 s.
        self._seal_mutex = threading.Lock()
        self._sealed = threading.Condition()  # notified after every seal attempt
        # The protected set of the last retention per (agent_version_id, vm_id), reused
        # when a later upload lands (see _run_seal_job).
        self._last_protected: dict[tuple[str, str], set[str]] = {}
        if mirror is not None:
            mirror.start(root / S3_QUEUE_DIRNAME, self._local, sign=self._sign)
        # Started after the mirror: a seal ends by queueing the upload.
        self._seal_queue = JobQueue(
            root / SEAL_QUEUE_DIRNAME,
            self._run_seal_job,
            self.log,
            retry_base_s=seal_retry_base_s,
            name="pal-seal",
        )
        self._seal_queue.start()

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
            mirror = S3Mirror.from_settings(settings, log)
        key = keyfile.load_or_create(settings.snapshot_key_path)
        return cls(
            settings.snapshots_root,
            mirror,
            log,
            key=key,
            protected_provider=protected_provider,
            signed_since_ns=os.stat(settings.snapshot_key_path).st_mtime_ns,
        )

    def close(self, timeout: float = 10.0, *, drain_seals: bool = True) -> None:
        """Seal what is pending (up to ``timeout``), then stop the workers. Seals and
        uploads not done stay queued on disk and run at the next start."""
        if drain_seals and not self._seal_queue.flush(timeout):
            self.log.warning("%d seal job(s) left for the next start", self._seal_queue.pending())
        self._seal_queue.stop(timeout)
        if self.mirror is not None:
            self.mirror.stop(timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until every pending seal and (if mirrored) S3 job is done. False on timeout."""
        deadline = time.monotonic() + timeout
        if not self._seal_queue.flush(timeout):
            return False
        return self.mirror is None or self.mirror.flush(max(0.0, deadline - time.monotonic()))

    def flush_seals(self, timeout: float) -> bool:
        """Wait until every pending seal is done (and its upload queued). False on timeout."""
        return self._seal_queue.flush(timeout)

    def pending_seals(self) -> int:
        return self._seal_queue.pending()

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
        """Checksum + fsync the small artifacts in ``staging``, write meta.json (unsealed
        when there are big artifacts), fsync, and rename the whole dir into place; then
        queue the seal of the big artifacts (which queues the S3 upload) and run retention.
        Returns as soon as the snapshot is published: the seal runs in the background.

        ``meta`` carries what only the caller knows (parentSnapshotId, qemuVersion,
        kernelVersion, memory "file"|"stream", ...); identity, sizes, checksums, sealed
        and createdAt are filled in here. ``ref.tenant_id`` is required: it is the owner.
        """
        started = time.monotonic()
        names = self._check_staging(staging, ref)

        sizes = {name: os.stat(staging / name).st_size for name in ARTIFACTS if name in names}
        inline = {name: staging / name for name, size in sizes.items() if size <= INLINE_SEAL_MAX_BYTES}
        hashed = hash_files(inline, fsync=True)
        hashed_at = time.monotonic()
        sealed = len(hashed) == len(sizes)
        # What the seal, and a restore before it, check the big artifacts against: they
        # are still the files captured (integrity.py, fingerprints).
        big = fingerprints(staging, sorted(set(sizes) - set(hashed)))
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
                "artifacts": sorted(sizes),
                "sizes": sizes,
                "sha256": {name: digest for name, (_, digest) in hashed.items()},
                "sealed": sealed,
                FINGERPRINTS_FIELD: big,
            }
        )
        write_json_durably(staging / META_FILE, self._sign(full_meta))
        fsync_path(staging)
        # The seal job is on disk before the snapshot is visible (a crash right after the
        # rename still seals it), and held so the worker cannot look before the rename.
        seal_job = None
        if not sealed:
            seal_job = self._seal_queue.submit({"op": "seal", "ref": ref.to_json()}, held=True)
        with self._lock:
            try:
                target = self._local.publish(staging, ref)
            except BaseException as exc:
                if seal_job is not None:
                    self._seal_queue.discard(seal_job)
                if isinstance(exc, FileExistsError):
                    raise Conflict(f"snapshot {ref.snapshot_id} already exists") from None
                raise
        if seal_job is not None:
            self._seal_queue.release(seal_job)
        self.log.info(
            "committed snapshot %s/%s/%s (%s) inline hash+fsync %.0f ms, total %.0f ms, %s",
            ref.agent_version_id,
            ref.vm_id,
            ref.snapshot_id,
            sizes,
            (hashed_at - started) * 1000,
            (time.monotonic() - started) * 1000,
            "sealed" if sealed else "seal queued",
        )
        if sealed:
            self._schedule_upload(ref)
        self._retention_after_commit(ref)
        return target

    def _check_staging(self, staging: Path, ref: SnapshotRef) -> set[str]:
        """The artifact names in ``staging``, a staging dir of this store holding every
        required artifact and nothing else, for a snapshot that does not exist yet."""
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
        return names

    def _retention_after_commit(self, ref: SnapshotRef) -> None:
        if self.protected_provider is None:
            return
        try:
            protected = set(self.protected_provider(ref.agent_version_id, ref.vm_id))
            protected.add(ref.snapshot_id)
            self.apply_retention(ref.agent_version_id, ref.vm_id, protected)
        except Exception:
            # The snapshot is safe; retention runs again after the next write.
            self.log.exception("retention after commit of %s failed", ref.snapshot_id)

    def _schedule_upload(self, ref: SnapshotRef) -> None:
        if self.mirror is None:
            return
        try:
            self.mirror.schedule_upload(SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id))
        except Exception:
            # Never fail a pause for the mirror; the local copy is complete.
            self.log.exception("could not queue the S3 upload of %s", ref.snapshot_id)

    # -- sealing ----------------------------------------------------------------------

    def seal_now(self, ref: SnapshotRef) -> dict[str, Any]:
        """Seal a local snapshot now if it is not yet (checksum + fsync its big
        artifacts, rewrite meta.json) and return its sealed meta. Idempotent. NotFound if
        there is no such local snapshot (or it is another tenant's); BackendError if its
        artifacts no longer have the sizes recorded at commit (damaged)."""
        meta = self._local_meta(self._local.path(ref), ref)
        if meta is None or not self._owned(meta, ref):
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        sealed = self._seal(ref)
        if sealed is None:
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        return sealed

    def ensure_uploaded(self, ref: SnapshotRef) -> None:
        """Make sure S3 holds a complete copy of this local snapshot now (sealing it first
        if needed), so another node can restore it: a resume elsewhere, a fork that
        spills to another node, a drain. Idempotent; the queued upload may run too.
        Unavailable without an S3 mirror or when S3 fails; NotFound without a local copy
        (then an S3 copy, if any, is all there is)."""
        if self.mirror is None:
            raise Unavailable(
                "no S3 mirror configured (S3_ENDPOINT, S3_BUCKET): snapshots cannot move between nodes"
            )
        anon = SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id)
        if self._s3_call(lambda m: m.read_meta(anon)) is not None:
            return
        meta = self.seal_now(anon)
        self._s3_call(lambda m: m.upload(anon, self._local.path(anon), meta))

    def wait_sealed(self, ref: SnapshotRef, timeout: float) -> bool:
        """Wait for the background seal. True once sealed, False on timeout; NotFound if
        the snapshot is not (or no longer) on local disk."""
        deadline = time.monotonic() + timeout
        with self._sealed:
            while True:
                meta = read_meta_file(self._local.path(ref))
                if meta is None or not self._owned(meta, ref):
                    raise NotFound(f"snapshot {ref.snapshot_id} not found")
                if is_sealed(meta):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._sealed.wait(min(left, 1.0))  # re-read now and then: seal_now elsewhere

    def _run_seal_job(self, job: dict[str, Any]) -> None:
        ref = SnapshotRef.from_json(job["ref"])
        try:
            sealed = self._seal(ref)
        except BackendError as exc:
            # Damaged before it was sealed: retrying cannot help, and it must not reach
            # S3. verify() reports it incomplete.
            self.log.error("cannot seal snapshot %s: %s", ref.snapshot_id, exc)
            raise DropJob(str(exc)) from exc
        if sealed is None:
            raise DropJob(f"snapshot {ref.snapshot_id} was deleted before it was sealed")
        self._schedule_upload(ref)
        self._schedule_s3_retention_after_upload(ref)

    def _schedule_s3_retention_after_upload(self, ref: SnapshotRef) -> None:
        """Run S3 retention again once this upload is through. The retention queued at
        commit ran before the seal, so it saw older snapshots only and may have kept one
        too many. Never deletes from S3 what is still on local disk (local retention
        already judged those) or what the last retention protected."""
        if self.mirror is None:
            return
        key = (ref.agent_version_id, ref.vm_id)
        with self._lock:
            last = self._last_protected.get(key)
            if last is None:
                return  # no retention for this VM in this process: nothing to redo
            local = {str(m.get("snapshotId")) for m in self._local.list_vm(*key)}
        try:
            self.mirror.schedule_retention(ref.agent_version_id, ref.vm_id, last | local | {ref.snapshot_id})
        except Exception:
            self.log.exception("could not queue S3 retention after the upload of %s", ref.snapshot_id)

    def _seal(self, ref: SnapshotRef) -> dict[str, Any] | None:
        """Seal one snapshot; None when it does not exist (deleted before or meanwhile)."""
        snap_dir = self._local.path(ref)
        try:
            with self._seal_mutex:
                meta = self._local_meta(snap_dir, ref)  # never re-sign what we did not write
                if meta is None:
                    return None
                if is_sealed(meta):
                    return meta
                started = time.monotonic()
                dir_ino = os.stat(snap_dir).st_ino
                todo = unsealed_artifacts(meta)
                try:
                    before = fingerprints(snap_dir, todo)
                    # The checksums must be of what was captured: a file changed since the
                    # commit (its fingerprint then) is damaged, never sealed as it is now.
                    changed = [n for n in todo if recorded_fingerprint(meta, n) not in (None, before[n])]
                    if changed:
                        raise BackendError(f"{ref.snapshot_id}: {changed} changed after the capture")
                    hashed = hash_files({name: snap_dir / name for name in todo}, fsync=True)
                    after = fingerprints(snap_dir, todo)
                except FileNotFoundError:
                    if read_meta_file(snap_dir) is None:
                        return None  # deleted while we hashed
                    lost = f"snapshot {ref.snapshot_id} lost an artifact before its seal"
                    raise BackendError(lost) from None
                if after != before:
                    changing = sorted(n for n in todo if after[n] != before[n])
                    raise BackendError(f"{ref.snapshot_id}: {changing} changed while being sealed")
                for name, (size, _) in hashed.items():
                    recorded = meta["sizes"][name]
                    if size != recorded:
                        raise BackendError(f"{ref.snapshot_id}: {name} is {size} bytes, not {recorded}")
                sealed = dict(meta)
                sealed["sha256"] = {**meta.get("sha256", {}), **{n: d for n, (_, d) in hashed.items()}}
                sealed["sealed"] = True
                old_fps = meta.get(FINGERPRINTS_FIELD)
                sealed[FINGERPRINTS_FIELD] = {**(old_fps if isinstance(old_fps, dict) else {}), **after}
                sealed = self._sign(sealed)
                # Under the store lock: retention/delete cannot move the dir between our
                # check and the rename, so we never write into a deleted snapshot.
                with self._lock:
                    current = read_meta_file(snap_dir)
                    if current is None or current.get("createdAt") != meta.get("createdAt"):
                        return None
                    if os.stat(snap_dir).st_ino != dir_ino:
                        return None
                    write_json_durably(snap_dir / META_FILE, sealed)
                    fsync_path(snap_dir)
                took_ms = (time.monotonic() - started) * 1000
                self.log.info("sealed snapshot %s (%s) in %.0f ms", ref.snapshot_id, todo, took_ms)
                return sealed
        finally:
            with self._sealed:
                self._sealed.notify_all()

    # -- reading ----------------------------------------------------------------------

    # -- memory files of fork children ------------------------------------------------

    # -- deleting ---------------------------------------------------------------------

    # -- helpers ----------------------------------------------------------------------
