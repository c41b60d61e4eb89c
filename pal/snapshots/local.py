"""The local tier: durable writes, atomic publish and removal of snapshot directories.

A snapshot directory is published by one ``rename`` of a complete staging directory
(artifacts and meta.json fsynced first), and removed by renaming it back under
``.staging`` before deleting its files. So at any instant a path under the root is either
a whole snapshot or absent, also across a crash.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from pal.snapshots.layout import META_FILE, STAGING_DIRNAME, SnapshotRef, vm_dir


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: dict[str, Any]) -> None:
    """Write JSON via a temp file + fsync + rename, so the file is either old or new."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def makedirs_durably(path: Path, stop_at: Path) -> None:
    """Create ``path`` and fsync each new directory's parent, up to ``stop_at``."""
    missing: list[Path] = []
    cur = path
    while not cur.exists() and cur != stop_at:
        missing.append(cur)
        cur = cur.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_path(d.parent)


def read_meta_file(snap_dir: Path) -> dict[str, Any] | None:
    """meta.json of a snapshot dir, or None when the dir is not a (complete) snapshot."""
    try:
        with open(snap_dir / META_FILE, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class LocalTier:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.staging_root = root / STAGING_DIRNAME
        self.staging_root.mkdir(parents=True, exist_ok=True)

    def path(self, ref: SnapshotRef) -> Path:
        return ref.local_dir(self.root)

    def new_staging(self, snapshot_id: str) -> Path:
        """A fresh empty dir under ``.staging``: same file system as the final place, so
        the publishing rename is atomic and artifacts can be reflinked into it."""
        d = self.staging_root / f"{snapshot_id}.{uuid.uuid4().hex[:8]}"
        d.mkdir()
        return d

    def is_staging(self, path: Path) -> bool:
        return path.resolve().parent == self.staging_root.resolve()

    def publish(self, staging: Path, ref: SnapshotRef) -> Path:
        """Rename a complete staging dir into place. Raises FileExistsError if taken."""
        target = self.path(ref)
        makedirs_durably(target.parent, self.root)
        if target.exists():
            raise FileExistsError(str(target))
        # rename(2) onto an existing non-empty dir fails; onto an empty one it would
        # replace it, which only a concurrent identical publish could have created.
        os.rename(staging, target)
        fsync_path(target.parent)
        fsync_path(self.staging_root)
        return target

    def remove(self, ref: SnapshotRef) -> bool:
        """Atomically make the snapshot disappear, then delete its files."""
        target = self.path(ref)
        graveyard = self.staging_root / f"{ref.snapshot_id}.deleting.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, graveyard)
        except FileNotFoundError:
            return False
        fsync_path(target.parent)
        shutil.rmtree(graveyard, ignore_errors=True)
        return True

    def list_vm(self, agent_version_id: str, vm_id: str) -> list[dict[str, Any]]:
        """Metas of the complete snapshots of one VM (dirs without meta.json are skipped)."""
        base = vm_dir(self.root, agent_version_id, vm_id)
        out: list[dict[str, Any]] = []
        try:
            entries = sorted(os.scandir(base), key=lambda e: e.name)
        except FileNotFoundError:
            return out
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            meta = read_meta_file(Path(entry.path))
            if meta is not None:
                out.append(meta)
        return out

    def vm_dirs(self) -> list[tuple[str, str]]:
        """(agent_version_id, vm_id) of every VM dir under the root (dot-dirs skipped)."""
        out: list[tuple[str, str]] = []
        for av in sorted(os.scandir(self.root), key=lambda e: e.name):
            if av.name.startswith(".") or not av.is_dir(follow_symlinks=False):
                continue
            for vm in sorted(os.scandir(av.path), key=lambda e: e.name):
                if not vm.name.startswith(".") and vm.is_dir(follow_symlinks=False):
                    out.append((av.name, vm.name))
        return out

    def remove_empty_vm_dir(self, agent_version_id: str, vm_id: str) -> None:
        """Drop a VM's dir (and its agent version's) once no snapshot is left in it."""
        base = vm_dir(self.root, agent_version_id, vm_id)
        for d in (base, base.parent):
            try:
                d.rmdir()
            except OSError:
                return

    def cleanup_staging(self, older_than_s: float = 0.0) -> list[str]:
        """Remove leftovers of interrupted commits, deletes and downloads."""
        removed: list[str] = []
        cutoff = time.time() - older_than_s
        for entry in os.scandir(self.staging_root):
            try:
                if entry.stat(follow_symlinks=False).st_mtime > cutoff:
                    continue
            except FileNotFoundError:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
        return removed
