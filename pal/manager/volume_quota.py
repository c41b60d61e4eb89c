"""A volume's ``sizeMib`` held by an XFS project quota (docs/volumes.md): the volume's
``data/`` is an XFS project (its id kept in ``volume.json``, inherited by everything made
under it), with a hard block limit of its size. A write past it fails with EDQUOT, in the
guest too (the NFS server passes the file system's answer on).

Only where the data dir's XFS is mounted with project quotas (``prjquota``, a mount option
XFS cannot turn on by remount); elsewhere a volume's size is not enforced and `pal doctor`
says so.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

FIRST_PROJECT = 0x50A10000  # Pal's project ids: far from what an operator numbers by hand


def _mount_of(path: Path) -> tuple[str, str] | None:
    """(mount point, super options) of the file system holding ``path``."""
    target = os.path.realpath(path)
    best: tuple[str, str] | None = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        point = left.split()[4].replace("\\040", " ")
        fields = right.split()
        if len(fields) < 3 or fields[0] != "xfs":
            continue
        if target == point or target.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) > len(best[0]):
                best = (point, fields[2])
    return best


def supported(path: Path) -> bool:
    """True when ``path`` is on an XFS mounted with project quotas enforced."""
    m = _mount_of(path)
    return m is not None and any(o in ("prjquota", "pquota") for o in m[1].split(","))


def _xfs_quota(mount: str, command: str) -> None:
    r = subprocess.run(["xfs_quota", "-x", "-c", command, mount], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise OSError(f"xfs_quota {command!r}: {(r.stderr or r.stdout).strip()[:300]}")


def next_project(used: set[int]) -> int:
    n = FIRST_PROJECT
    while n in used:
        n += 1
    return n


def apply(data_dir: Path, project: int, size_mib: int) -> bool:
    """Make ``data_dir`` project ``project`` (inherited) limited to ``size_mib``; False
    where the file system has no project quotas (nothing done)."""
    m = _mount_of(data_dir)
    if m is None or not supported(data_dir):
        return False
    _xfs_quota(m[0], f"project -s -p {data_dir} {project}")
    _xfs_quota(m[0], f"limit -p bhard={size_mib}m {project}")
    return True


def release(data_dir: Path, project: int) -> None:
    """The volume is gone: its project's limit goes too (its blocks went with its files)."""
    m = _mount_of(data_dir)
    if m is not None and supported(data_dir):
        _xfs_quota(m[0], f"limit -p bhard=0 {project}")
