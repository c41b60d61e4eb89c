"""The S3 tier: a mirror of the local snapshot dir under ``snapshots/`` in one bucket.

Writes (uploads, deletes, retention) go through a persistent background queue
(:class:`JobQueue`), so a commit never waits for S3 and an unreachable server only delays
the mirror. An S3 snapshot counts as present only once its ``meta.json`` exists, so
uploads write it last and deletes remove it first.

Only sealed snapshots are uploaded (the store queues the upload when the seal is done),
and the upload checks every artifact it sends against the size and sha256 in meta.json
before it writes meta.json. Large artifacts travel as ``pal-sparse-v1`` objects (format in
layout.py): a 2 GiB sparse disk with 180 MB of data uploads ~180 MB. Downloads rebuild the
holes and check each artifact's sha256 against meta.json.

Encrypted (the default, ``PAL_SNAPSHOT_ENCRYPTION``): every artifact, big or small, is
uploaded as a ``pal-enc-v1`` object of its sparse stream under a fresh data key, whose
wrapped form is the ``key.json`` object (crypt.py); the uploaded meta.json says
``"s3Encryption": "pal-enc-v1"`` under its HMAC, so a download refuses any object of such a
snapshot that is not encrypted. Snapshots uploaded unencrypted (before encryption, or
with it off) still download as before. ``PAL_S3_SSE`` adds S3's server-side encryption
(request parameters only) to every object written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from pal import keyfile
from pal.config import Settings
from pal.errors import BackendError
from pal.snapshots import crypt, retention
from pal.snapshots.hashing import sparse_sha256
from pal.snapshots.integrity import is_sealed, is_signed
from pal.snapshots.jobqueue import DropJob, JobQueue
from pal.snapshots.layout import (
    ARTIFACTS,
    ENCRYPTED_ENCODING,
    ENCRYPTION_META_FIELD,
    INLINE_SEAL_MAX_BYTES,
    KEY_FILE,
    META_FILE,
    S3_ENCODING_METADATA_KEY,
    S3_PREFIX,
    SPARSE_ENCODING,
    SnapshotRef,
    vm_s3_prefix,
)
from pal.snapshots.local import LocalTier, read_meta_file
from pal.snapshots.sparse_object import SparseEncoder, decode_to_file

Signer = Callable[[dict[str, Any]], dict[str, Any]]
_CHUNK = 1 << 20
_ZERO_CHUNK = bytes(_CHUNK)
_MISSING_CODES = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
# A remote meta.json is untrusted input: ours are a few KiB; more than this is refused
# before it is read into memory or parsed.
MAX_META_BYTES = 1 << 20


class CorruptLocalCopy(BackendError):
    """A local artifact does not match its meta.json: it must not be mirrored."""


def _is_missing(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code")) in _MISSING_CODES


class S3Mirror:
    def __init__(
        self,
        endpoint: str | None,
        bucket: str,
        region: str = "us-east-1",
        log: logging.Logger | None = None,
        *,
        retry_base_s: float = 1.0,
        retry_max_s: float = 60.0,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        encryption_key: bytes | None = None,
        encrypt: bool = True,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
    ) -> None:
        """``encryption_key``: the snapshot encryption key (crypt.py); uploads are encrypted
        under it when ``encrypt``, and encrypted snapshots download only with it. ``sse``,
        ``sse_kms_key_id``: S3 server-side encryption asked for on every object written
        (``AES256`` or ``aws:kms``; config.S3_SSE_MODES)."""
        self.endpoint = endpoint
        self.bucket = bucket
        self.region = region
        self.log = log or logging.getLogger("pal.snapshots.s3")
        self._clock = clock
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        # Path-style addressing: S3-compatible servers (MinIO, moto, Ceph) rarely have
        # wildcard DNS for virtual-host buckets. Credentials come from the default chain
        # (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY). One botocore retry only: our queue
        # does the patient retrying, a blocked worker would delay every other job.
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            config=Config(
                s3={"addressing_style": "path"},
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                retries={"total_max_attempts": 2, "mode": "standard"},
            ),
        )
        self._transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=32 << 20)
        # The sparse stream is not seekable, so boto3 buffers each part in memory: small
        # parts and few in flight bound that to ~max_concurrency * chunksize.
        self._sparse_transfer = TransferConfig(
            multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=4
        )
        # Bytes sent and seconds taken by the last upload (for logs, benchmarks, tests).
        self.last_upload: dict[str, float] = {}
        self._bucket_ready = False
        self._queue: JobQueue | None = None
        self._local: LocalTier | None = None
        self._sign: Signer | None = None
        self._encryption_key = encryption_key
        self.encrypts = encrypt and encryption_key is not None
        self._sse_args: dict[str, str] = {}
        if sse:
            self._sse_args["ServerSideEncryption"] = sse
            if sse_kms_key_id:
                self._sse_args["SSEKMSKeyId"] = sse_kms_key_id
        # One upload of a snapshot at a time (the queue's and ensure_uploaded's): two
        # encrypted uploads draw two data keys, and must not interleave their objects.
        self._upload_locks: dict[SnapshotRef, list[Any]] = {}
        self._upload_locks_guard = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, log: logging.Logger | None = None) -> S3Mirror:
        """The mirror at S3_ENDPOINT/S3_BUCKET, encrypting uploads unless
        PAL_SNAPSHOT_ENCRYPTION=off (its key is read, or made, even then: a node that
        uploads in the clear still restores encrypted snapshots of its bucket)."""
        assert settings.s3_bucket is not None
        return cls(
            settings.s3_endpoint,
            settings.s3_bucket,
            settings.s3_region,
            log,
            encryption_key=keyfile.load_or_create(settings.snapshot_encryption_key_path),
            encrypt=settings.snapshot_encryption,
            sse=settings.s3_sse,
            sse_kms_key_id=settings.s3_sse_kms_key_id,
        )

    # -- background queue -------------------------------------------------------------

    def start(
        self,
        queue_dir: Path,
        local: LocalTier,
        sign: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        """Start the background worker; jobs pending in ``queue_dir`` are retried. ``sign``
        adds the HMAC to a meta written before metas were signed, before it is uploaded."""
        self._local = local
        self._sign = sign
        self._queue = JobQueue(
            queue_dir,
            self._run_job,
            self.log,
            retry_base_s=self._retry_base_s,
            retry_max_s=self._retry_max_s,
            name="pal-s3-mirror",
        )
        self._queue.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._queue is not None:
            self._queue.stop(timeout)

    def flush(self, timeout: float) -> bool:
        """Retry pending jobs now and wait for the queue to drain. False on timeout."""
        return self._queue.flush(timeout) if self._queue is not None else True

    def pending(self) -> int:
        return self._queue.pending() if self._queue is not None else 0

    def schedule_upload(self, ref: SnapshotRef) -> None:
        self._submit({"op": "upload", "ref": ref.to_json()})

    def schedule_delete(self, ref: SnapshotRef) -> None:
        self._submit({"op": "delete", "ref": ref.to_json()})

    def schedule_vm_delete(self, agent_version_id: str, vm_id: str, keep: set[str]) -> None:
        """Delete every S3 snapshot of a VM except ``keep`` (in the background, retried)."""
        self._submit(
            {"op": "delete_vm", "agentVersionId": agent_version_id, "vmId": vm_id, "keep": sorted(keep)}
        )

    def schedule_retention(self, agent_version_id: str, vm_id: str, protected: set[str]) -> None:
        self._submit(
            {
                "op": "retention",
                "agentVersionId": agent_version_id,
                "vmId": vm_id,
                "protected": sorted(protected),
            }
        )

    def _submit(self, job: dict[str, Any]) -> None:
        if self._queue is None:
            raise RuntimeError("S3Mirror.start() was not called")
        self._queue.submit(job)

    def _run_job(self, job: dict[str, Any]) -> None:
        try:
            self._dispatch(job)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                self._bucket_ready = False  # bucket removed (or a fresh server): recreate
            raise

    def _dispatch(self, job: dict[str, Any]) -> None:
        op = job.get("op")
        if op == "upload":
            ref = SnapshotRef.from_json(job["ref"])
            assert self._local is not None
            src = self._local.path(ref)
            meta = read_meta_file(src)
            if meta is None:
                # Deleted locally (retention, delete) before it reached S3: nothing to do;
                # a delete job queued after this one removes any partial upload.
                raise DropJob(f"{ref.snapshot_id} is no longer on local disk")
            if not is_sealed(meta):
                # Only a job from before sealing existed; the seal job queues a new one.
                raise DropJob(f"{ref.snapshot_id} is not sealed yet")
            try:
                self.upload(ref, src, meta)
            except CorruptLocalCopy as exc:
                self.log.error("not mirroring snapshot %s: %s", ref.snapshot_id, exc)
                raise DropJob(str(exc)) from exc
        elif op == "delete":
            self.delete(SnapshotRef.from_json(job["ref"]))
        elif op == "delete_vm":
            self.delete_vm(job["agentVersionId"], job["vmId"], set(job.get("keep", [])))
        elif op == "retention":
            self.apply_retention(job["agentVersionId"], job["vmId"], set(job.get("protected", [])))
        else:
            raise DropJob(f"unknown job {op!r}")

    # -- direct operations (blocking; used by the worker and by locate) ---------------

    def ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if not _is_missing(exc):
                raise
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            try:
                self._client.create_bucket(**kwargs)
            except ClientError as create_exc:
                code = create_exc.response.get("Error", {}).get("Code")
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
            self.log.info("created S3 bucket %s", self.bucket)
        self._bucket_ready = True

    def upload(self, ref: SnapshotRef, src_dir: Path, meta: dict[str, Any] | None = None) -> None:
        """Upload a sealed local snapshot; meta.json last, so it is complete on S3 only
        when every artifact is there and matched meta. Raises CorruptLocalCopy (and
        writes no meta.json) when an artifact differs from what meta records. A snapshot
        S3 already holds complete is not sent again."""
        if meta is None:
            meta = read_meta_file(src_dir)
        if meta is None or not is_sealed(meta):
            raise BackendError(f"snapshot {ref.snapshot_id} is not sealed: not uploading it")
        ref = SnapshotRef(ref.agent_version_id, ref.vm_id, ref.snapshot_id)
        with self._upload_lock(ref):
            self.ensure_bucket()
            if self._already_uploaded(ref, meta):
                self.log.info("snapshot %s is already on S3: not uploading it again", ref.snapshot_id)
                return
            self._upload_locked(ref, src_dir, meta)

    def _upload_locked(self, ref: SnapshotRef, src_dir: Path, meta: dict[str, Any]) -> None:
        sizes: dict[str, int] = meta["sizes"]
        digests: dict[str, str] = meta["sha256"]
        started = time.monotonic()
        sent = 0
        data_key = None
        if self.encrypts:
            assert self._encryption_key is not None
            data_key = crypt.new_data_key()
            wrapped = crypt.wrap(data_key, self._encryption_key, ref)
            self._put_object(ref.s3_key(KEY_FILE), wrapped)
            sent += len(wrapped)
        for name in sorted(sizes):
            got, n = self._put_artifact(ref, src_dir / name, name, sizes[name], data_key)
            sent += n
            if got != (sizes[name], digests[name]):
                # The object is there but meta.json is not, so S3 has no snapshot; the
                # delete queued with the local copy's removal tidies the objects.
                raise CorruptLocalCopy(f"{name} of {ref.snapshot_id} does not match its sha256 in meta.json")
        meta = self._meta_for_upload(ref, meta)
        body = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
        self._put_object(ref.s3_key(META_FILE), body)
        took = time.monotonic() - started
        self.last_upload = {"bytes": float(sent + len(body)), "seconds": took}
        self.log.info(
            "uploaded snapshot %s/%s/%s to S3%s: %.1f MB in %.2fs",
            ref.agent_version_id,
            ref.vm_id,
            ref.snapshot_id,
            " (encrypted)" if data_key is not None else "",
            (sent + len(body)) / 1e6,
            took,
        )

    def _put_artifact(
        self, ref: SnapshotRef, path: Path, name: str, size: int, data_key: bytes | None
    ) -> tuple[tuple[int | None, str | None], int]:
        """Upload one artifact; returns ((size, digest) of what was read, bytes sent)."""
        key = ref.s3_key(name)
        if data_key is not None:
            with SparseEncoder(path) as plain:
                sealed = crypt.EncryptingReader(plain.read, data_key, crypt.artifact_identity(ref, name))
                extra = {"Metadata": {S3_ENCODING_METADATA_KEY: ENCRYPTED_ENCODING}, **self._sse_args}
                self._client.upload_fileobj(
                    sealed, self.bucket, key, ExtraArgs=extra, Config=self._sparse_transfer
                )
                return (plain.size, plain.digest), sealed.bytes_out
        if size > INLINE_SEAL_MAX_BYTES:
            with SparseEncoder(path) as stream:
                extra = {"Metadata": {S3_ENCODING_METADATA_KEY: SPARSE_ENCODING}, **self._sse_args}
                self._client.upload_fileobj(
                    stream, self.bucket, key, ExtraArgs=extra, Config=self._sparse_transfer
                )
                return (stream.size, stream.digest), stream.bytes_out
        got = sparse_sha256(path)
        extra = dict(self._sse_args)
        self._client.upload_file(str(path), self.bucket, key, ExtraArgs=extra, Config=self._transfer)
        return got, got[0]

    def _put_object(self, key: str, body: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=key, Body=body, **self._sse_args)

    def _meta_for_upload(self, ref: SnapshotRef, meta: dict[str, Any]) -> dict[str, Any]:
        """The meta.json S3 gets: it says (under its HMAC) whether the objects are encrypted."""
        out = dict(meta)
        if self.encrypts:
            out[ENCRYPTION_META_FIELD] = crypt.SCHEME
        else:
            out.pop(ENCRYPTION_META_FIELD, None)
        if out != meta or not is_signed(out):
            if self._sign is None:
                if out != meta:
                    raise BackendError(f"snapshot {ref.snapshot_id}: no key to sign its meta.json with")
                return out
            out = self._sign(out)  # also a meta sealed before metas were signed
        return out

    def _already_uploaded(self, ref: SnapshotRef, meta: dict[str, Any]) -> bool:
        """S3 holds a complete copy of this very snapshot (its meta: same capture, same
        checksums). Re-sending it would replace its data key under a reader's feet."""
        try:
            remote = self.read_meta(ref)
        except BackendError:
            return False  # not a meta of ours: the upload replaces it
        return (
            remote is not None
            and remote.get("createdAt") == meta.get("createdAt")
            and remote.get("sha256") == meta.get("sha256")
        )

    @contextlib.contextmanager
    def _upload_lock(self, ref: SnapshotRef) -> Iterator[None]:
        with self._upload_locks_guard:
            entry = self._upload_locks.setdefault(ref, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._upload_locks_guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._upload_locks[ref]

    def read_meta(self, ref: SnapshotRef) -> dict[str, Any] | None:
        """meta.json of the S3 copy, or None if there is no complete copy."""
        self.ensure_bucket()
        raw = self._read_small(ref.s3_key(META_FILE), MAX_META_BYTES + 1)
        if raw is None:
            return None
        if len(raw) > MAX_META_BYTES:
            raise self._refused(ref, f"its meta.json is larger than {MAX_META_BYTES} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise self._refused(ref, f"its meta.json is not valid JSON ({type(exc).__name__})") from None
        if not isinstance(data, dict):
            raise self._refused(ref, "its meta.json is not an object")
        return data

    def _refused(self, ref: SnapshotRef, problem: str) -> BackendError:
        """The error for an S3 copy that is not one of ours (the store's words for a
        refused meta: ``SnapshotStore._remote_meta``)."""
        self.log.error("refusing the S3 copy of snapshot %s: %s", ref.snapshot_id, problem)
        return BackendError(f"S3 copy of snapshot {ref.snapshot_id} refused: {problem}")

    def download(self, ref: SnapshotRef, dest_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """Download the artifacts named in ``meta`` (already authenticated by the store:
        integrity.check_meta) into ``dest_dir``, then meta.json. Only known artifact names
        are ever written, each at most its recorded size. Encrypted objects are opened
        chunk by chunk (crypt.SnapshotUnreadable for any that does not authenticate);
        sparse objects are decoded with their holes and checked against meta's sha256
        (BackendError if not); raw ones skip zero blocks so they stay sparse (the store
        checks them after the download)."""
        sizes = meta.get("sizes")
        digests = meta.get("sha256")
        if not isinstance(sizes, dict) or not isinstance(digests, dict):
            raise BackendError(f"S3 meta.json of {ref.snapshot_id} has no sizes or checksums")
        unknown = set(sizes) - set(ARTIFACTS)
        if unknown:
            raise BackendError(f"S3 meta.json of {ref.snapshot_id} lists unknown artifacts")
        scheme = meta.get(ENCRYPTION_META_FIELD)
        if scheme not in (None, crypt.SCHEME):
            raise BackendError(f"S3 copy of {ref.snapshot_id} uses an unknown encryption {scheme!r}")
        data_key = self._data_key(ref) if scheme is not None else None

        def fetch(name: str) -> None:
            expected = int(sizes[name])
            obj = self._client.get_object(Bucket=self.bucket, Key=ref.s3_key(name))
            body = obj["Body"]
            encoding = obj.get("Metadata", {}).get(S3_ENCODING_METADATA_KEY)
            if (encoding == ENCRYPTED_ENCODING) != (data_key is not None):
                # Its signed meta says which: an object swapped for a plaintext one (or
                # the other way round) is refused, never decoded.
                said = "encrypted" if data_key is not None else "not encrypted"
                raise crypt.SnapshotUnreadable(
                    f"S3 object {name} of snapshot {ref.snapshot_id} has encoding {encoding!r},"
                    f" but its meta.json says the snapshot is {said}"
                )
            if encoding in (SPARSE_ENCODING, ENCRYPTED_ENCODING):
                read = body.read
                if data_key is not None:
                    identity = crypt.artifact_identity(ref, name)
                    read = crypt.DecryptingReader(body.read, data_key, identity).read
                got = decode_to_file(read, dest_dir / name, expected_size=expected)
                if got != (expected, digests.get(name)):
                    raise BackendError(f"S3 copy of {name} of {ref.snapshot_id} fails its sha256")
                return
            if encoding is not None:
                raise BackendError(f"S3 object {name} of {ref.snapshot_id} has unknown encoding {encoding!r}")
            self._write_raw(body, dest_dir / name, expected, f"S3 object {name} of {ref.snapshot_id}")

        with ThreadPoolExecutor(max_workers=max(1, len(sizes)), thread_name_prefix="pal-s3-get") as pool:
            for fut in [pool.submit(fetch, str(name)) for name in sizes]:
                fut.result()
        with open(dest_dir / META_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        return meta

    @staticmethod
    def _write_raw(body: Any, dest: Path, expected: int, what: str) -> None:
        """A raw object (a small artifact uploaded unencrypted, or before sparse objects
        existed); the store checks its sha256 after the download."""
        written = 0
        with open(dest, "wb") as f:
            while chunk := body.read(_CHUNK):
                written += len(chunk)
                if written > expected:
                    raise BackendError(f"{what} is larger than recorded")
                if len(chunk) == _CHUNK and chunk == _ZERO_CHUNK:
                    f.seek(len(chunk), os.SEEK_CUR)
                else:
                    f.write(chunk)
            f.truncate(written)
            f.flush()
            os.fsync(f.fileno())

    def _data_key(self, ref: SnapshotRef) -> bytes:
        """The data key of an encrypted S3 snapshot, from its key.json (crypt.unwrap)."""
        if self._encryption_key is None:
            raise crypt.SnapshotUnreadable(
                f"the S3 copy of snapshot {ref.snapshot_id} is encrypted and this node has no"
                " snapshot encryption key (PAL_SNAPSHOT_ENCRYPTION_KEY_FILE)"
            )
        body = self.read_key_object(ref)
        if body is None:
            raise crypt.SnapshotUnreadable(f"the S3 copy of snapshot {ref.snapshot_id} has no key.json")
        return crypt.unwrap(body, self._encryption_key, ref)

    # -- wrapped data keys (crypt.py; rotation: rekey.py) -----------------------------

    def read_key_object(self, ref: SnapshotRef) -> bytes | None:
        """The snapshot's key.json (at most crypt.MAX_KEY_OBJECT_BYTES + 1 bytes read), or
        None when it has none."""
        return self._read_small(ref.s3_key(KEY_FILE), crypt.MAX_KEY_OBJECT_BYTES + 1)

    def _read_small(self, key: str, at_most: int) -> bytes | None:
        """Up to ``at_most`` bytes of a small object (the caller refuses one that fills
        them), or None when there is no such object."""
        try:
            obj = self._client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise
        body = obj["Body"]
        try:
            return bytes(body.read(at_most))
        finally:
            body.close()

    def write_key_object(self, ref: SnapshotRef, body: bytes) -> None:
        self._put_object(ref.s3_key(KEY_FILE), body)

    def snapshot_objects(self) -> dict[SnapshotRef, set[str]]:
        """Every snapshot prefix in the bucket with the object names under it (a listing)."""
        self.ensure_bucket()
        out: dict[SnapshotRef, set[str]] = {}
        for key in self._list_keys(f"{S3_PREFIX}/"):
            parts = key.split("/")
            if len(parts) != 5:
                continue  # a key we did not write
            try:
                ref = SnapshotRef(parts[1], parts[2], parts[3])
            except Exception:
                continue
            out.setdefault(ref, set()).add(parts[4])
        return out

    def delete(self, ref: SnapshotRef) -> None:
        """Delete the S3 copy: meta.json first, so a reader never sees it as complete."""
        self.ensure_bucket()
        self._client.delete_object(Bucket=self.bucket, Key=ref.s3_key(META_FILE))
        keys = [key for key in self._list_keys(ref.s3_prefix) if not key.endswith("/" + META_FILE)]
        for i in range(0, len(keys), 1000):
            self._client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )

    def delete_vm(self, agent_version_id: str, vm_id: str, keep: set[str]) -> list[str]:
        """Delete every snapshot under the VM's prefix (complete or not) except ``keep``."""
        self.ensure_bucket()
        prefix = vm_s3_prefix(agent_version_id, vm_id)
        doomed: set[str] = set()
        for key in self._list_keys(prefix):
            sid = key[len(prefix) :].split("/", 1)[0]
            if sid and sid not in keep:
                doomed.add(sid)
        for sid in sorted(doomed):
            try:
                ref = SnapshotRef(agent_version_id, vm_id, sid)
            except Exception:
                continue  # a key we did not write
            self.delete(ref)
        if doomed:
            self.log.info("deleted the S3 snapshots of VM %s: %s", vm_id, sorted(doomed))
        return sorted(doomed)

    def list_vms(self) -> list[tuple[str, str]]:
        """(agent_version_id, vm_id) of every VM with objects under ``snapshots/``."""
        self.ensure_bucket()
        out: list[tuple[str, str]] = []
        pager = self._client.get_paginator("list_objects_v2")
        for page in pager.paginate(Bucket=self.bucket, Prefix=f"{S3_PREFIX}/", Delimiter="/"):
            for av in page.get("CommonPrefixes", []):
                for sub in pager.paginate(Bucket=self.bucket, Prefix=av["Prefix"], Delimiter="/"):
                    for vm in sub.get("CommonPrefixes", []):
                        parts = vm["Prefix"].rstrip("/").split("/")
                        if len(parts) == 3:
                            out.append((parts[1], parts[2]))
        return out

    def list_vm(self, agent_version_id: str, vm_id: str) -> list[dict[str, Any]]:
        """Metas of the complete S3 snapshots of one VM."""
        self.ensure_bucket()
        prefix = vm_s3_prefix(agent_version_id, vm_id)
        out: list[dict[str, Any]] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, Delimiter="/"
        ):
            for common in page.get("CommonPrefixes", []):
                snapshot_id = common["Prefix"][len(prefix) :].rstrip("/")
                try:
                    ref = SnapshotRef(agent_version_id, vm_id, snapshot_id)
                except Exception:
                    continue  # a key we did not write
                meta = self.read_meta(ref)
                if meta is not None:
                    out.append(meta)
        return out

    def apply_retention(self, agent_version_id: str, vm_id: str, protected: set[str]) -> list[str]:
        metas = self.list_vm(agent_version_id, vm_id)
        now = self._clock()
        doomed = retention.to_delete(retention.ages_from_metas(metas, now), protected, now)
        for snapshot_id in doomed:
            self.delete(SnapshotRef(agent_version_id, vm_id, snapshot_id))
        if doomed:
            self.log.info("S3 retention for %s/%s deleted %s", agent_version_id, vm_id, doomed)
        return doomed

    def total_bytes(self) -> int:
        """Bytes of every object under the snapshot prefix (a listing: for periodic stats).
        A read only: a bucket that does not exist yet holds 0 bytes (a scrape makes none)."""
        total = 0
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{S3_PREFIX}/"
            ):
                total += sum(int(obj.get("Size", 0)) for obj in page.get("Contents", []))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchBucket":
                raise
            return 0
        return total

    def _list_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return keys
