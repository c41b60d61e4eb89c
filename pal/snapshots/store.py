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

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from pal import keyfile
from pal.config import Settings
from pal.errors import BackendError, Conflict, InvalidRequest, NotFound, Unavailable
from pal.ids import validate_id
from pal.snapshots import retention
from pal.snapshots.hashing import HASH_ALGO, hash_files
from pal.snapshots.integrity import (
    FINGERPRINTS_FIELD,
    check_meta,
    fingerprints,
    is_sealed,
    is_signed,
    meta_authentic,
    recorded_fingerprint,
    sign_meta,
    unsealed_artifacts,
    verify_dir,
)
from pal.snapshots.jobqueue import DropJob, JobQueue
from pal.snapshots.layout import (
    ARTIFACTS,
    FORK_MEM_DIRNAME,
    INLINE_SEAL_MAX_BYTES,
    MEM_ARTIFACT,
    META_FILE,
    REQUIRED_ARTIFACTS,
    S3_QUEUE_DIRNAME,
    SEAL_QUEUE_DIRNAME,
    SnapshotRef,
)
from pal.snapshots.local import LocalTier, fsync_path, read_meta_file, write_json_durably
from pal.snapshots.s3 import S3Mirror
from pal.vmm import disks


class MetaNotAuthentic(BackendError):
    """A meta.json that is signed but not by our key, or that describes another snapshot."""


# (agent_version_id, vm_id) -> snapshot ids of that VM retention must keep.
ProtectedProvider = Callable[[str, str], Iterable[str]]


class SnapshotStore:
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
        if self.protected_provider is not None:
            try:
                protected = set(self.protected_provider(ref.agent_version_id, ref.vm_id))
                protected.add(ref.snapshot_id)
                self.apply_retention(ref.agent_version_id, ref.vm_id, protected)
            except Exception:
                # The snapshot is safe; retention runs again after the next write.
                self.log.exception("retention after commit of %s failed", ref.snapshot_id)
        return target

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

    # -- memory files of fork children ------------------------------------------------

    def fork_mem(self, ref: SnapshotRef) -> Path:
        """A reflinked copy of the snapshot's ``mem`` for fork children to map privately.
        The children's QEMUs get this file (their jail makes it writable to them), never
        the artifact itself, so a child that escaped into its QEMU can reach its siblings'
        unwritten pages at worst, never the snapshot. One copy per snapshot, shared by all
        its live children; the caller drops it when the last of them stops."""
        src = self._local.path(ref) / MEM_ARTIFACT
        dst = self._fork_mem_path(ref.snapshot_id)
        with self._fork_mem_lock:
            if dst.exists():
                return dst
            dst.parent.mkdir(mode=0o700, exist_ok=True)
            tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}")
            try:
                disks.clone(src, tmp, qcow2_ok=False)
                os.replace(tmp, dst)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return dst

    def drop_fork_mem(self, snapshot_id: str) -> None:
        with self._fork_mem_lock:
            self._fork_mem_path(snapshot_id).unlink(missing_ok=True)

    def prune_fork_mem(self, keep: Iterable[str]) -> list[str]:
        """Remove the fork memory files of snapshots no live VM maps (at start-up)."""
        keep_names = {f"{validate_id(k, 'snapshot_id')}.mem" for k in keep}
        removed = []
        with self._fork_mem_lock:
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.root / FORK_MEM_DIRNAME):
                    if entry.name not in keep_names:
                        Path(entry.path).unlink(missing_ok=True)
                        removed.append(entry.name)
        return removed

    def _fork_mem_path(self, snapshot_id: str) -> Path:
        return self.root / FORK_MEM_DIRNAME / f"{validate_id(snapshot_id, 'snapshot_id')}.mem"

    def list_vm(
        self, agent_version_id: str, vm_id: str, tenant_id: str | None = None
    ) -> list[dict[str, Any]]:
        """Metas of one VM's complete local snapshots, oldest first (optionally one tenant's)."""
        metas = self._local.list_vm(agent_version_id, vm_id)
        if tenant_id is not None:
            metas = [m for m in metas if m.get("tenantId") == tenant_id]
        return sorted(metas, key=lambda m: (retention.created_unix(m) or 0.0, str(m.get("snapshotId"))))

    def stored_bytes(self, ref: SnapshotRef) -> int:
        """Bytes a local snapshot's artifacts take on disk (reflinked extents counted as if
        its own: what it would cost alone, or on S3)."""
        total, snap_dir = 0, self._local.path(ref)
        for name in ARTIFACTS:
            with contextlib.suppress(OSError):
                total += os.stat(snap_dir / name).st_blocks * 512
        return total

    def vms(self) -> set[tuple[str, str]]:
        """(agent_version_id, vm_id) of every VM that has a snapshot on either tier (S3
        skipped when unreachable): what the control plane's sweep checks against its VMs."""
        found = set(self._local.vm_dirs())
        if self.mirror is not None:
            try:
                found |= set(self._s3_call(lambda m: m.list_vms()))
            except Unavailable as exc:
                self.log.warning("cannot list the S3 tier for the sweep: %s", exc)
        return found

    def delete_vm(self, agent_version_id: str, vm_id: str, keep: Iterable[str] = ()) -> list[str]:
        """Delete every snapshot of a VM on both tiers (S3 in the background, retried)
        except ``keep`` (what live forks still map). Returns the local ids deleted."""
        keep = set(keep)
        removed = []
        with self._lock:
            for meta in self._local.list_vm(agent_version_id, vm_id):
                sid = str(meta.get("snapshotId"))
                if sid not in keep and self._local.remove(SnapshotRef(agent_version_id, vm_id, sid)):
                    removed.append(sid)
            self._local.remove_empty_vm_dir(agent_version_id, vm_id)
            if not keep:
                self._last_protected.pop((agent_version_id, vm_id), None)
        if removed:
            self.log.info("deleted the snapshots of VM %s: %s (kept %s)", vm_id, removed, sorted(keep))
        if self.mirror is not None:
            self.mirror.schedule_vm_delete(agent_version_id, vm_id, keep)
        return removed

    def local_bytes(self) -> int:
        """Bytes allocated on disk by complete local snapshots (staging and queues left
        out). Reflinked extents are counted once per file that references them."""
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    continue  # deleted meanwhile
        return total

    def s3_bytes(self) -> int | None:
        """Bytes of the S3 tier (None without a mirror); raises Unavailable when S3 is down."""
        if self.mirror is None:
            return None
        return int(self._s3_call(lambda m: m.total_bytes()))

    def s3_queue_depth(self) -> int:
        return self.mirror.pending() if self.mirror is not None else 0

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
            # The VM's last snapshot gone (a fork's, after its children): no empty dir stays.
            self._local.remove_empty_vm_dir(ref.agent_version_id, ref.vm_id)
        if removed:
            self.log.info("deleted local snapshot %s", ref.snapshot_id)
        if self.mirror is not None:
            self.mirror.schedule_delete(SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id))

    def apply_retention(self, agent_version_id: str, vm_id: str, protected: set[str]) -> list[str]:
        """Apply retention to one VM's snapshots: local now, S3 in the background.
        Returns the ids deleted locally."""
        with self._lock:
            self._last_protected[(agent_version_id, vm_id)] = set(protected)
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
