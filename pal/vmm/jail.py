"""Each QEMU's own unprivileged identity, and who may open which file.

QEMU is exec'd already as a uid/gid of its own: Python's subprocess drops between fork and
exec (setgroups, setregid, setreuid; every capability goes with root), so QEMU never holds
root, and its seccomp filter can deny set*id as well (cmdline.py). It runs in its VM's
cgroups (cgroups.py), with a minimal environment, holding only the descriptors the manager
handed it (handoff.py). What its uid may open by itself:

- its own RAM file (``vms/<id>/mem``, owned by its uid, 0600), which QEMU 7.2 opens by
  name (``/proc/self/fd/N``) to map it;
- the RAM copy that the fork children of one snapshot map copy-on-write
  (``snapshots/.fork-mem/<snapshot>.mem``, a reflink of the artifact: no QEMU maps an
  artifact): ``root:<group>`` 0660 while any of them runs, ``<group>`` being allocated for
  that one file and given to exactly those QEMUs. QEMU 7.2 opens a RAM file read-write
  even to map it private, and its ``readonly=on`` maps it PROT_READ, which no guest can
  run on (docs/security.md).

Everything else (disks, config drive, images, snapshots, sockets) stays root's and reaches
QEMU only as a descriptor. Without root (a developer's non-root run) there is no drop.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal.errors import Unavailable
from pal.vmm import holefilter

UID_BASE = 200_000  # above any distribution's dynamic range; never a login user
UID_COUNT = 65_536
GROUP_BASE = UID_BASE + UID_COUNT  # gids of RAM files shared by fork children
GROUP_COUNT = 65_536
KVM_DEVICE = Path("/dev/kvm")
# QEMU needs no environment (it spawns nothing); PATH only so its messages are ordinary.
QEMU_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
SHARED_RAM_MODE = 0o660
PRIVATE_MODE = 0o600


def _free(in_use: set[int], base: int, count: int, what: str) -> int:
    for n in range(base, base + count):
        if n not in in_use:
            return n
    raise Unavailable(f"no free {what}: too many VMs on this node")


def exec_kwargs(
    run_as: tuple[int, int] | None, groups: tuple[int, ...], accel: str, *, private_ram: bool = False
) -> dict[str, Any]:
    """Keyword arguments for the subprocess exec of a QEMU: identity and environment, and
    for a QEMU that maps its RAM file private (a fork child), the filter that keeps it
    from punching holes in the file its siblings map (holefilter.py).

    ``extra_groups`` is always given when dropping: without it the child would keep
    root's supplementary groups.
    """
    kw: dict[str, Any] = {"env": dict(QEMU_ENV)}
    if private_ram:
        kw["preexec_fn"] = holefilter.preexec  # after the drop below; survives the exec
    if run_as is None:
        return kw
    extra = list(groups)
    if accel == "kvm":
        with contextlib.suppress(OSError):
            st = KVM_DEVICE.stat()
            if st.st_mode & 0o006 != 0o006:  # not world read-write: the device's group
                extra.append(st.st_gid)
    kw.update(user=run_as[0], group=run_as[1], extra_groups=extra)
    return kw


@dataclass
class _Shared:
    gid: int
    users: set[str] = field(default_factory=set)


class Jail:
    """Allocates QEMU uids and shared-file groups on one node; tracks who holds what."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = os.geteuid() == 0 if enabled is None else enabled
        # Keyed by the VM's host slot (pal/manager/slots.py), not by its public id.
        self._uids: dict[str, int] = {}  # slot -> uid (gid == uid)
        self._shared: dict[Path, _Shared] = {}  # RAM file mapped by several QEMUs -> its group

    def identity(self, vm_id: str) -> tuple[int, int] | None:
        """The (uid, gid) for ``vm_id``'s QEMU (the same for the VM's whole stay here)."""
        if not self.enabled:
            return None
        uid = self._uids.get(vm_id)
        if uid is None:
            uid = _free(set(self._uids.values()), UID_BASE, UID_COUNT, "QEMU uid")
            self._uids[vm_id] = uid
        return uid, uid

    def share(self, path: Path, vm_id: str) -> tuple[int, ...]:
        """Let ``vm_id``'s QEMU open the RAM file ``path`` that others may map too; returns
        the supplementary groups its exec needs."""
        if not self.enabled:
            return ()
        path = Path(path)
        entry = self._shared.get(path)
        if entry is None:
            gid = _free({e.gid for e in self._shared.values()}, GROUP_BASE, GROUP_COUNT, "shared-file group")
            os.chown(path, 0, gid)
            os.chmod(path, SHARED_RAM_MODE)
            entry = self._shared[path] = _Shared(gid)
        entry.users.add(vm_id)
        return (entry.gid,)

    def adopt(self, vm_id: str, uid: int, shared: Path | None) -> tuple[int, ...]:
        """Re-register a QEMU a previous manager started (uid and shared file as left)."""
        self._uids[vm_id] = uid
        if shared is None:
            return ()
        path = Path(shared)
        entry = self._shared.get(path)
        if entry is None:
            gid = path.stat().st_gid
            if not GROUP_BASE <= gid < GROUP_BASE + GROUP_COUNT:
                raise Unavailable(f"{path} is not shared with its QEMU (group {gid})")
            entry = self._shared[path] = _Shared(gid)
        entry.users.add(vm_id)
        return (entry.gid,)

    def release(self, vm_id: str) -> None:
        """``vm_id``'s QEMU is gone: free its uid; a shared file no one maps is root's again."""
        self._uids.pop(vm_id, None)
        for path, entry in list(self._shared.items()):
            entry.users.discard(vm_id)
            if not entry.users:
                del self._shared[path]
                with contextlib.suppress(FileNotFoundError):  # deleted with its snapshot
                    os.chown(path, 0, 0)
                    os.chmod(path, PRIVATE_MODE)


def give_to(path: Path, run_as: tuple[int, int] | None) -> None:
    """Make a VM's own RAM file its QEMU's (0600): QEMU opens it by name to map it."""
    if run_as is not None:
        os.chown(path, *run_as)
    os.chmod(path, PRIVATE_MODE)


def real_uid(pid: int) -> int | None:
    """The real uid of a live process (None if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
