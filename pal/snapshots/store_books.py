"""A store's books: fork memory files, what each VM holds and where, deletion and
retention. Part of SnapshotStore (store.py)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pal.errors import NotFound, Unavailable
from pal.ids import validate_id
from pal.snapshots import retention
from pal.snapshots.layout import (
    ARTIFACTS,
    FORK_MEM_DIRNAME,
    MEM_ARTIFACT,
    SnapshotRef,
)
from pal.snapshots.local import read_meta_file
from pal.snapshots.store_core import StoreCore
from pal.vmm import disks


class StoreBooks(StoreCore):
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
