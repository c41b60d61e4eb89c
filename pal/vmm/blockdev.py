"""Which block device a VM's disk I/O hits, read from sysfs: where per-VM disk limits go.

QEMU reads and writes the VM's disk file in the data dir, so its I/O is submitted to the
block device of the data dir's file system: a whole disk for a partition (cgroup limits
are per disk, never per partition), the loop device for a loop-mounted image (the data
dir's XFS image on hosts whose own file system cannot reflink), the device-mapper device
for LVM or dm-crypt. That device is where the per-VM throttle goes:

- below a **loop** device the I/O is the loop driver's worker's. On cgroup v1 the worker is
  in no VM's cgroup, so a limit on the backing disk would bound nothing (measured on these
  hosts: a 2 MiB/s limit on the backing disk let 2.7 GB/s of direct writes through the
  loop, the same limit on the loop device held them to 2.1 MB/s). On v2 (Linux 5.12+) the
  worker charges the VM's cgroup, so the limit on the loop device is enough there too.
- **device-mapper** remaps each bio in the submitter's context, keeping its cgroup: the
  limit on the dm device bounds what reaches the disks under it.

What the device chain is also decides whether an IO *weight* can work: a weight is honoured
by the scheduler of the disk at the bottom (BFQ, or blk-iocost on v2), and only if that disk
still sees the VM's cgroup (through dm always; through a loop only on v2).

Everything reads through a :class:`BlockHost` (the sysfs root and how a path's device is
found), so the host matrix tests run against fake trees.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SYS = Path("/sys")
MOUNTINFO = Path("/proc/self/mountinfo")
LOOP_MAJOR = 7
MAX_DEPTH = 4  # loops of loops: enough for any sane host, and no cycle runs forever


@dataclass(frozen=True)
class Disk:
    """One block device of the chain: ``dev`` is ``MAJ:MIN``."""

    dev: str
    name: str
    kind: str  # "loop" | "dm" | "disk"
    scheduler: str  # the chosen I/O scheduler ("none" for bio-based devices)
    schedulers: tuple[str, ...] = ()  # all the kernel offers for it


@dataclass(frozen=True)
class DataDevice:
    """The device QEMU's disk I/O is submitted to (``top``) and what lies under it."""

    top: Disk
    below: tuple[Disk, ...] = ()  # through loops and dm, down to the disks
    backing: str = ""  # a loop's backing file, for the words

    @property
    def bottom(self) -> Disk:
        return self.below[-1] if self.below else self.top

    def describe(self) -> str:
        if not self.below:
            return f"{self.top.name} ({self.top.dev}, {self.top.scheduler})"
        under = f"{self.backing} on " if self.backing else ""
        bottom = f"{under}{self.bottom.name}, {self.bottom.scheduler}"
        return f"{self.top.name} ({self.top.dev}, {self.top.kind}: {bottom})"


@dataclass
class BlockHost:
    """sysfs as the kernel shows it, and a path's device number (both replaced in tests)."""

    sys: Path = SYS
    mountinfo: Path = MOUNTINFO
    stat_dev: Callable[[Path], int] = field(default=lambda p: os.stat(p).st_dev)

    def _read(self, path: Path) -> str:
        return path.read_text().strip()

    def device_of(self, path: Path) -> tuple[DataDevice | None, str]:
        """The device holding ``path``, or None and why there is none (tmpfs, NFS...)."""
        return self._device_of(path, 0)

    def _device_of(self, path: Path, depth: int) -> tuple[DataDevice | None, str]:
        try:
            num = self.stat_dev(path)
        except OSError as exc:
            return None, f"cannot stat {path}: {exc.strerror}"
        major, minor = os.major(num), os.minor(num)
        if major == 0:  # btrfs and other anonymous devices: the mount's source names it
            source = self._mount_source(num)
            if source is None or not source.startswith("/dev/"):
                return None, f"{path} is on a file system without a block device ({source or 'none'})"
            try:
                rdev = os.stat(source).st_rdev
            except OSError as exc:
                return None, f"cannot stat {source}: {exc.strerror}"
            major, minor = os.major(rdev), os.minor(rdev)
        return self._chain(major, minor, depth)

    def _mount_source(self, num: int) -> str | None:
        want = f"{os.major(num)}:{os.minor(num)}"
        try:
            text = self.mountinfo.read_text()
        except OSError:
            return None
        for line in text.splitlines():
            left, _, right = line.partition(" - ")
            parts, rparts = left.split(), right.split()
            if len(parts) > 2 and parts[2] == want and len(rparts) > 1:
                return rparts[1]
        return None

    def _disk(self, major: int, minor: int) -> tuple[Path, Disk] | None:
        link = self.sys / "dev" / "block" / f"{major}:{minor}"
        if not link.exists():
            return None
        d = link.resolve()
        if (d / "partition").exists():  # limits are per disk: the partition's parent
            d = d.parent
        try:
            dev = self._read(d / "dev")
        except OSError:
            return None
        kind = "loop" if (d / "loop").is_dir() else "dm" if (d / "dm").is_dir() else "disk"
        chosen, offered = _scheduler(d)
        return d, Disk(dev, d.name, kind, chosen, offered)

    def _chain(self, major: int, minor: int, depth: int) -> tuple[DataDevice | None, str]:
        found = self._disk(major, minor)
        if found is None:
            return None, f"no block device {major}:{minor} in {self.sys}/dev/block"
        d, top = found
        below: list[Disk] = []
        backing = ""
        if depth < MAX_DEPTH and top.kind == "loop":
            inner: DataDevice | None = None
            try:
                backing = self._read(d / "loop" / "backing_file")
                inner, _ = self._device_of(Path(backing), depth + 1)
            except OSError:
                pass
            if inner is not None:
                below = [inner.top, *inner.below]
        elif depth < MAX_DEPTH and top.kind == "dm":
            slaves = sorted((d / "slaves").iterdir()) if (d / "slaves").is_dir() else []
            if slaves:  # several (RAID, striping): the first stands for them
                try:
                    maj, mino = (int(x) for x in self._read(slaves[0] / "dev").split(":"))
                except (OSError, ValueError):
                    maj = -1
                if maj >= 0:
                    inner, _ = self._chain(maj, mino, depth + 1)
                    if inner is not None:
                        below = [inner.top, *inner.below]
        return DataDevice(top, tuple(below), backing), ""


def _scheduler(d: Path) -> tuple[str, tuple[str, ...]]:
    try:
        text = (d / "queue" / "scheduler").read_text().strip()
    except OSError:
        return "none", ()
    names = tuple(w.strip("[]") for w in text.split())
    chosen = next((w.strip("[]") for w in text.split() if w.startswith("[")), names[0] if names else "none")
    return chosen, names
