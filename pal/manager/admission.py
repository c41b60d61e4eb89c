"""Admission on the node: enough free disk and memory before a spawn or a snapshot, checked
before any work, so a full disk is a clear 507 and never a guest killed by SIGBUS (its RAM
is a file in the data dir) or a half-written snapshot.

Both checks are conservative: a VM may touch all of its RAM (the RAM file and the snapshot's
``mem`` may need that many bytes on disk), and ``MIN_FREE_MIB`` more stays free for the
store, logs and the other VMs' writes.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pal.errors import InsufficientStorage

# Left free on the data dir's file system after any admitted spawn or snapshot (the node
# also reports itself unhealthy below it).
MIN_FREE_MIB = 1024


def disk_free_mib(path: Path) -> int:
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize // (1 << 20))


def memory_available_mib() -> int | None:
    """The host's MemAvailable (None when it cannot be read: no check then)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return None


def check_disk(path: Path, need_mib: int, what: str) -> None:
    """507 unless ``need_mib`` MiB plus the reserve are free on ``path``'s file system."""
    free = disk_free_mib(path)
    if free < need_mib + MIN_FREE_MIB:
        raise InsufficientStorage(
            f"not enough disk on this node for {what}: it needs about {need_mib} MiB plus "
            f"{MIN_FREE_MIB} MiB kept free, and {free} MiB are free; free space or delete "
            "paused VMs and snapshots"
        )


def check_memory(need_mib: int, what: str) -> None:
    """507 unless the host has ``need_mib`` MiB of memory available."""
    avail = memory_available_mib()
    if avail is not None and avail < need_mib:
        raise InsufficientStorage(
            f"not enough memory on this node for {what}: it needs {need_mib} MiB and "
            f"{avail} MiB are available"
        )
