"""Each volume's NFS ``Export_Id`` (docs/volumes.md, "A resume on another node"): the same on
every node, for as long as the volume lives.

ganesha puts the export's id in every NFSv3 file handle it gives out (beside the file
system's own handle of the file), so a guest whose VM moves to another node, or whose node's
ganesha restarts, keeps working only if the volume is exported under the same id there:
measured (scripts/volume-mount-experiment.py ``move``), a guest snapshotted behind one
ganesha and restored behind another exporting the same directory reads on through its
cached handles, its open files and its working directory when the ids match, and meets
``Stale file handle`` on all of them when they differ (a remount then helps new lookups
only, never an open file).

So the id is the volume's, not the server's: chosen at the volume's creation (or at its
first export, for a volume made before ids were kept), unique among the volumes of the
volumes root (a shared root: the cluster's), and recorded in its ``volume.json``. The
uniqueness is a claim file ``.export-ids/<n>`` holding the volume id, made with ``link``
(atomic on a local file system and on NFS or CephFS, where several nodes may claim at
once); the search starts at a hash of the volume id, so two nodes choosing for the same
volume at once walk the same slots and the second finds the first's claim.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path

from pal.errors import Unavailable

EXPORT_IDS = ".export-ids"
FIRST, LAST = 1, 65535  # ganesha's Export_Id is 16 bits; 0 is its pseudo root
SPAN = LAST - FIRST + 1


def _start(volume_id: str) -> int:
    return int.from_bytes(hashlib.sha256(volume_id.encode()).digest()[:4], "big") % SPAN


def _owner(claim: Path) -> str | None:
    try:
        return claim.read_text()
    except FileNotFoundError:
        return None


def claim(root: Path, volume_id: str) -> int:
    """A free Export_Id claimed for ``volume_id`` (or the one it already holds)."""
    d = root / EXPORT_IDS
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = d / f".{volume_id}.{uuid.uuid4().hex}"
    with tmp.open("w") as f:
        f.write(volume_id)
        f.flush()
        os.fsync(f.fileno())
    try:
        start = _start(volume_id)
        for i in range(SPAN):
            n = FIRST + (start + i) % SPAN
            slot = d / str(n)
            owner = _owner(slot)
            if owner is None:
                try:
                    os.link(tmp, slot)
                    return n
                except FileExistsError:
                    owner = _owner(slot)
            if owner == volume_id:
                return n
        raise Unavailable(f"no NFS export id left for volume {volume_id} ({SPAN} in use)")
    finally:
        tmp.unlink(missing_ok=True)


def release(root: Path, volume_id: str, export_id: int) -> None:
    """The volume is gone: its id is free again (only if the claim is still its own)."""
    slot = root / EXPORT_IDS / str(export_id)
    if _owner(slot) == volume_id:
        with contextlib.suppress(FileNotFoundError):
            slot.unlink()
