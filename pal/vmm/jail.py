"""Each QEMU's own unprivileged identity.

QEMU opens everything it needs at start-up as root (RAM file, disks, sockets, /dev/kvm),
then drops to a uid/gid of its own (`-runas`), under seccomp (`-sandbox on`) and its VM's
cgroups (cgroups.py). A guest that escaped into its QEMU would hold no root, no other VM's
uid, and no way to open files: snapshot I/O goes through descriptors the manager passes.
"""

from __future__ import annotations

import os

from pal.errors import Unavailable

UID_BASE = 200_000  # above any distribution's dynamic range; never a login user
UID_COUNT = 65_536


def pick_identity(in_use: set[int]) -> tuple[int, int] | None:
    """The lowest free (uid, gid) for a new QEMU; None when Pal does not run as root."""
    if os.geteuid() != 0:
        return None
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        if uid not in in_use:
            return uid, uid
    raise Unavailable("no free QEMU uid: too many VMs on this node")
