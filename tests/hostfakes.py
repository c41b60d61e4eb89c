"""Fake host trees for the host probes (pal/vmm/cgroups.py, blockdev.py, pal/manager/hostcaps.py):
a cgroupfs that behaves like the kernel where it matters (interface files appear on mkdir
for the controllers a level has, a knob that does not exist cannot be written, a v2 cgroup
with processes cannot enable controllers for its children: EBUSY) and a sysfs of block
devices (disks, partitions, loop devices with their backing file, device-mapper volumes with
their slaves, each queue's schedulers)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pal.vmm.blockdev import BlockHost
from pal.vmm.cgroups import CgroupFs, CgroupHost

THROTTLE_V1 = [
    "blkio.throttle.read_bps_device",
    "blkio.throttle.write_bps_device",
    "blkio.throttle.read_iops_device",
    "blkio.throttle.write_iops_device",
]
V1_KNOBS = {
    "cpu": ["cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares"],
    "cpuacct": ["cpuacct.usage"],
    "memory": ["memory.limit_in_bytes"],
    "pids": ["pids.max"],
    "blkio": ["blkio.bfq.weight", *THROTTLE_V1],
    "cpuset": ["cpuset.cpus", "cpuset.mems"],
}
V2_KNOBS = {
    "cpu": ["cpu.max", "cpu.stat"],
    "memory": ["memory.max"],
    "pids": ["pids.max"],
    "io": ["io.weight", "io.max"],
    "cpuset": ["cpuset.cpus"],
}


class FakeCgroupFs(CgroupFs):
    def __init__(self, root: Path, v2: bool, knobs: dict[str, list[str]]) -> None:
        self.root, self.v2, self.knobs = root, v2, knobs
        self.proc = root.parent / "proc-self-cgroup"

    def _controller_v1(self, path: Path) -> str:
        return path.relative_to(self.root).parts[0]

    def mkdir(self, path: Path) -> None:
        if path.exists():
            return
        path.mkdir()
        (path / "cgroup.procs").write_text("")
        if self.v2:
            enabled = (path.parent / "cgroup.subtree_control").read_text().split()
            (path / "cgroup.controllers").write_text(" ".join(enabled))
            (path / "cgroup.subtree_control").write_text("")
            for c in enabled:
                for k in self.knobs.get(c, []):
                    (path / k).write_text("max" if k.endswith(".max") else "")
        else:
            for k in self.knobs.get(self._controller_v1(path), []):
                (path / k).write_text("")

    def write(self, path: Path, text: str) -> None:
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "no such knob", str(path))
        d = path.parent
        if path.name == "cgroup.subtree_control":
            wanted = {w.lstrip("+") for w in text.split()}
            if not wanted <= set((d / "cgroup.controllers").read_text().split()):
                raise OSError(errno.ENOENT, "controller not available")
            if d != self.root and (d / "cgroup.procs").read_text().split():
                raise OSError(errno.EBUSY, "cgroup has processes")
            path.write_text(" ".join(sorted(wanted)))
            return
        if path.name == "cgroup.procs":
            # a process is in one cgroup per hierarchy (v1: one hierarchy per controller)
            hierarchy = self.root if self.v2 else self.root / self._controller_v1(d)
            for procs in hierarchy.rglob("cgroup.procs"):
                pids = [p for p in procs.read_text().split() if p != text]
                procs.write_text(" ".join(pids))
            path.write_text(" ".join([*d.joinpath("cgroup.procs").read_text().split(), text]))
            return
        path.write_text(text)

    def rmdir(self, path: Path) -> None:
        if (path / "cgroup.procs").read_text().split():
            raise OSError(errno.EBUSY, "cgroup has processes")
        for f in path.iterdir():  # interface files go with the directory
            f.unlink()
        os.rmdir(path)


V1_ALL = ("cpu", "cpuacct", "memory", "pids", "blkio")


def v1_tree(
    tmp_path: Path,
    controllers: tuple[str, ...] = V1_ALL,
    knobs: dict[str, list[str]] | None = None,
    own: str | None = None,
    comount: bool = False,
) -> FakeCgroupFs:
    """A cgroup v1 host. ``own``: Pal's cgroup in every hierarchy (default: / but memory's
    /svc); ``comount``: cpu and cpuacct mounted together, as systemd does (cpu, cpuacct are
    links to ``cpu,cpuacct``)."""
    fs = FakeCgroupFs(tmp_path / "cg", False, knobs or V1_KNOBS)
    lines = []
    fs.root.mkdir(parents=True)
    for i, c in enumerate(controllers):
        mine = own or ("/svc" if c == "memory" else "/")
        if comount and c in ("cpu", "cpuacct"):
            joint = fs.root / "cpu,cpuacct"
            joint.mkdir(exist_ok=True)
            (fs.root / c).symlink_to("cpu,cpuacct")
            (joint / mine.lstrip("/")).mkdir(parents=True, exist_ok=True)
            if c == "cpuacct":
                (joint / "cpuacct.usage").write_text("0")
            lines.append(f"{i + 1}:cpu,cpuacct:{mine}")
            continue
        (fs.root / c / mine.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if c == "cpuacct":
            (fs.root / c / "cpuacct.usage").write_text("0")
        lines.append(f"{i + 1}:{c}:{mine}")
    fs.proc.write_text("\n".join([*dict.fromkeys(lines), "0::/"]) + "\n")
    return fs


def v2_tree(
    tmp_path: Path,
    own_procs: list[int],
    available: str = "cpu io memory pids",
    knobs: dict[str, list[str]] | None = None,
    cost_qos: str = "",
) -> FakeCgroupFs:
    """A cgroup v2 host with Pal in ``system.slice/pal.service`` holding ``own_procs``
    (only Pal: a service with Delegate=yes; Pal and others: a login shell's scope).
    ``cost_qos``: the root's io.cost.qos (blk-iocost enabled where it says enable=1)."""
    fs = FakeCgroupFs(tmp_path / "cg", True, knobs or V2_KNOBS)
    root = fs.root
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(available)
    (root / "cgroup.subtree_control").write_text(available)
    (root / "cgroup.procs").write_text("")
    if cost_qos:
        (root / "io.cost.qos").write_text(cost_qos)
    fs.mkdir(root / "system.slice")
    fs.write(root / "system.slice" / "cgroup.subtree_control", "+" + " +".join(available.split()))
    svc = root / "system.slice" / "pal.service"
    fs.mkdir(svc)
    (svc / "cgroup.procs").write_text(" ".join(str(p) for p in own_procs))
    fs.proc.write_text("0::/system.slice/pal.service\n")
    return fs


def dev_num(dev: str) -> int:
    major, minor = (int(x) for x in dev.split(":"))
    return os.makedev(major, minor)


@dataclass
class FakeSys:
    """A sysfs of block devices, and which device each path is on (``mounts``: the longest
    prefix wins), for :class:`BlockHost`."""

    root: Path
    mounts: dict[str, str] = field(default_factory=dict)  # path prefix -> MAJ:MIN

    def disk(
        self,
        name: str,
        dev: str,
        schedulers: str = "[none] mq-deadline kyber",
        *,
        loop: str | None = None,
        slaves: tuple[Path, ...] = (),
    ) -> Path:
        """A whole device: a disk, a loop device (``loop``: its backing file) or, with
        ``slaves``, a device-mapper volume over them."""
        virtual = loop is not None or name.startswith("dm-")
        d = self.root / "devices" / ("virtual" if virtual else "pci0000:00") / "block" / name
        (d / "queue").mkdir(parents=True)
        (d / "dev").write_text(dev + "\n")
        (d / "queue" / "scheduler").write_text(schedulers + "\n")
        if loop is not None:
            (d / "loop").mkdir()
            (d / "loop" / "backing_file").write_text(loop + "\n")
        if name.startswith("dm-"):
            (d / "dm").mkdir()
            (d / "dm" / "name").write_text("vg-data\n")
            (d / "slaves").mkdir()
            for s in slaves:
                (d / "slaves" / s.name).symlink_to(s)
        self._link(name, dev, d)
        return d

    def partition(self, disk: Path, name: str, dev: str) -> Path:
        p = disk / name
        p.mkdir()
        (p / "partition").write_text("1\n")
        (p / "dev").write_text(dev + "\n")
        self._link(name, dev, p, block=False)
        return p

    def _link(self, name: str, dev: str, target: Path, block: bool = True) -> None:
        for d in [self.root / "dev" / "block", *([self.root / "block"] if block else [])]:
            d.mkdir(parents=True, exist_ok=True)
        (self.root / "dev" / "block" / dev).symlink_to(target)
        if block:
            (self.root / "block" / name).symlink_to(target)

    def stat_dev(self) -> Callable[[Path], int]:
        def stat(path: Path) -> int:
            best = max((p for p in self.mounts if str(path).startswith(p)), key=len, default=None)
            if best is None:
                raise FileNotFoundError(errno.ENOENT, "not on a fake device", str(path))
            return dev_num(self.mounts[best])

        return stat

    def block_host(self, mountinfo: Path | None = None) -> BlockHost:
        return BlockHost(self.root, mountinfo or self.root / "no-mountinfo", self.stat_dev())


def discover(fs: FakeCgroupFs, block: BlockHost | None = None) -> CgroupHost:
    return CgroupHost.discover(root=fs.root, proc_self=fs.proc, fs=fs, block=block or BlockHost())
