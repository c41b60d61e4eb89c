"""The node's volumes (docs/volumes.md): each one a directory of the node's volumes root
(``<data dir>/volumes/<volume id>/``), holding ``volume.json`` (its tenant and size) and
``data/``, the volume's files, which a mount exports and the files API reads.

A directory rather than a sparse image file: several VMs mount a volume at once (an image
holds one file system with one writer), a file-level server (NFS, docs/volumes.md,
"Design") exports a directory, and the files API needs no mount on the host. The size is a
limit, not a reservation: nothing is allocated until written.

Root's alone (0700, like everything in the data dir); every write is a rename of a whole
file, so a crash leaves the old ``volume.json`` or the new one. A delete renames the
directory out of the way first (``.deleting-<id>``), so a volume is there whole or not at
all, and a crash in the middle is finished by the next delete or :meth:`VolumeFiles.sweep`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from pal.errors import Conflict, InvalidRequest, NotFound
from pal.ids import validate_id
from pal.manager import volume_ids, volume_quota
from pal.wire.volumes import VolumeCreate, VolumeDeleted, VolumeInfo, VolumeRef, VolumeResize

META = "volume.json"
DATA = "data"
DELETING = ".deleting-"


class VolumeFiles:
    """The volumes of one node, under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = asyncio.Lock()  # one change at a time: creates and deletes are rare

    def path(self, volume_id: str) -> Path:
        return self.root / validate_id(volume_id, "volume id")

    def data_dir(self, volume_id: str) -> Path:
        """Where the volume's files are (what a mount exports)."""
        return self.path(volume_id) / DATA

    def _meta(self, volume_id: str) -> dict[str, Any] | None:
        try:
            meta = json.loads((self.path(volume_id) / META).read_text())
        except FileNotFoundError:
            return None
        return meta if isinstance(meta, dict) else None

    def size_mib(self, volume_id: str) -> int:
        """The volume's recorded size; 404 for a volume this node does not hold."""
        meta = self._meta(volume_id)
        if meta is None:
            raise NotFound(f"volume {volume_id} not found on this node")
        return int(meta["sizeMib"])

    def _write_meta(self, volume_id: str, meta: dict[str, Any]) -> None:
        d = self.path(volume_id)
        tmp = d / f".{META}.{uuid.uuid4().hex}.tmp"  # unique: nodes sharing PAL_VOLUMES_DIR write at once
        with tmp.open("w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / META)
        _fsync_dir(d)

    async def create(self, r: VolumeCreate) -> VolumeInfo:
        async with self._lock:
            return await asyncio.to_thread(self._create, r)

    def _create(self, r: VolumeCreate) -> VolumeInfo:
        meta = self._meta(r.volume_id)
        if meta is not None:
            if meta.get("tenantId") != r.tenant_id:
                raise Conflict(f"volume {r.volume_id} exists on this node for another tenant")
            return VolumeInfo(volume_id=r.volume_id, size_mib=int(meta["sizeMib"]))
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        d = self.path(r.volume_id)
        d.mkdir(mode=0o700, exist_ok=True)  # a create that died before its meta: reused
        (d / DATA).mkdir(mode=0o700, exist_ok=True)
        meta = {"volumeId": r.volume_id, "tenantId": r.tenant_id, "sizeMib": r.size_mib}
        meta["exportId"] = volume_ids.claim(self.root, r.volume_id)  # the same on every node
        if volume_quota.supported(self.root):  # sizeMib held by an XFS project quota
            meta["project"] = volume_quota.next_project(self._projects())
            volume_quota.apply(d / DATA, meta["project"], r.size_mib)
        self._write_meta(r.volume_id, meta)
        _fsync_dir(self.root)
        return VolumeInfo(volume_id=r.volume_id, size_mib=r.size_mib)

    async def export_id(self, volume_id: str) -> int:
        """The volume's NFS Export_Id (volume_ids.py), claimed and recorded for a volume made
        before ids were kept; 404 for a volume that is not here."""
        async with self._lock:
            return await asyncio.to_thread(self._export_id, volume_id)

    def _export_id(self, volume_id: str) -> int:
        meta = self._meta(volume_id)
        if meta is None:
            raise NotFound(f"volume {volume_id} is not on this node")
        if isinstance(meta.get("exportId"), int):
            return int(meta["exportId"])
        n = volume_ids.claim(self.root, volume_id)
        self._write_meta(volume_id, {**meta, "exportId": n})
        return n

    async def resize(self, r: VolumeResize) -> VolumeInfo:
        async with self._lock:
            return await asyncio.to_thread(self._resize, r)

    def _resize(self, r: VolumeResize) -> VolumeInfo:
        meta = self._meta(r.volume_id)
        if meta is None:
            raise NotFound(f"volume {r.volume_id} not found on this node")
        if r.size_mib < int(meta["sizeMib"]):
            raise InvalidRequest(
                f"volume {r.volume_id} is {meta['sizeMib']} MiB: a volume only grows (asked {r.size_mib} MiB)"
            )
        if isinstance(meta.get("project"), int):
            volume_quota.apply(self.data_dir(r.volume_id), meta["project"], r.size_mib)
        self._write_meta(r.volume_id, {**meta, "sizeMib": r.size_mib})
        return VolumeInfo(volume_id=r.volume_id, size_mib=r.size_mib)

    async def delete(self, r: VolumeRef) -> VolumeDeleted:
        async with self._lock:
            return await asyncio.to_thread(self._delete, r.volume_id)

    def _delete(self, volume_id: str) -> VolumeDeleted:
        d = self.path(volume_id)
        gone = self.root / f"{DELETING}{volume_id}"
        existed = d.exists()
        meta = (self._meta(volume_id) or {}) if existed else {}
        project, export_id = meta.get("project"), meta.get("exportId")
        if existed:
            os.replace(d, gone)  # replaces a leftover of an earlier delete that died
            _fsync_dir(self.root)
        if gone.exists():
            shutil.rmtree(gone)
        if isinstance(project, int):
            volume_quota.release(self.root, project)
        if isinstance(export_id, int):
            volume_ids.release(self.root, volume_id, export_id)
        return VolumeDeleted(volume_id=volume_id, deleted=existed)

    def sweep(self) -> int:
        """Finish the deletes a crash interrupted (the node's start); how many."""
        if not self.root.is_dir():
            return 0
        left = [p for p in self.root.iterdir() if p.name.startswith(DELETING)]
        for p in left:
            shutil.rmtree(p, ignore_errors=True)
        return len(left)

    def _projects(self) -> set[int]:
        """The XFS project ids of this node's volumes (volume_quota.py)."""
        return {p for v in self.ids() if isinstance(p := (self._meta(v) or {}).get("project"), int)}

    def ids(self) -> list[str]:
        """The volumes this node holds."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if not p.name.startswith(".") and (p / META).exists()
        )


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
