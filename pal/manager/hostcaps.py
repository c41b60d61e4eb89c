"""What this host gives a node, one capability a line: used (or found), missing with what
that costs and how to get it, off by the operator's choice with what that loses, or not
needed. Only a capability without which no VM starts ``stops_vms``.

`pal doctor` prints these lines (and exits non-zero only for one that stops VMs), the
server logs them once at start (a missing one as a warning, once, not per VM), and a VM's
own ``limitsApplied`` says which limits held for it. Every probe reads the host through a
:class:`HostView` (cgroupfs, sysfs, procfs, /dev, /run/netns and the few probes that must
run something), so the host matrix tests (tests/unit/test_host_matrix.py) run them against
fake trees of the hosts users have.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pal.config import Settings
from pal.errors import Unavailable
from pal.network import netns, nft
from pal.vmm import accel, cgroups, disks
from pal.vmm.blockdev import BlockHost, DataDevice
from pal.vmm.cgroups import CgroupFs, CgroupHost
from pal.vmm.cmdline import SECCOMP_OPT_OUT, SECCOMP_OPT_OUT_LOSS
from pal.vmm.disk_limits import DiskLimits
from pal.vmm.versions import qemu_supports_sandbox, qemu_version

State = Literal["used", "missing", "off", "not needed"]


@dataclass(frozen=True)
class Capability:
    name: str
    state: State
    detail: str  # what was found and how Pal uses it, or what is missing
    effect: str = ""  # missing or off: what VMs lose
    fix: str = ""  # missing: how to get it
    stops_vms: bool = False

    @property
    def ok(self) -> bool | None:
        """doctor's mark: True used, False stops VMs, None everything else (informative)."""
        if self.stops_vms:
            return False
        return True if self.state == "used" else None

    def line(self) -> str:
        text = self.detail if self.state == "used" else f"{self.state.upper()}: {self.detail}"
        if self.effect:
            text += f"; effect: {self.effect}"
        if self.fix:
            text += f"; fix: {self.fix}"
        return text


@dataclass
class HostView:
    """Where the probes look (the real host by default; fake trees in tests)."""

    cgroup_root: Path = cgroups.ROOT
    proc_self_cgroup: Path = cgroups.PROC_SELF_CGROUP
    cgroup_fs: CgroupFs = field(default_factory=CgroupFs)
    block: BlockHost = field(default_factory=BlockHost)
    proc_sys: Path = Path("/proc/sys")
    dev: Path = Path("/dev")
    netns_dir: Path = netns.NETNS_DIR
    mountinfo: Path = Path("/proc/self/mountinfo")
    qemu_version: Callable[[], str] = qemu_version
    qemu_sandbox: Callable[[], bool] = qemu_supports_sandbox
    nft_available: Callable[[], None] = nft.available
    reflink: Callable[[Path], bool] = disks.reflink_supported
    probe_accel: Callable[[Settings], accel.AccelInfo] = accel.probe
    writable: Callable[[Path], bool] = field(default=lambda p: os.access(p, os.W_OK))
    euid: Callable[[], int] = os.geteuid
    # The node's own cgroup layout (the server's, discovered once), else discovered here.
    cgroup_host: Callable[[], CgroupHost] | None = None

    def discover_cgroups(self) -> CgroupHost:
        if self.cgroup_host is not None:
            return self.cgroup_host()
        return CgroupHost.discover(self.cgroup_root, self.proc_self_cgroup, self.cgroup_fs, self.block)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def report(settings: Settings, view: HostView | None = None) -> list[Capability]:
    """Every capability of this host, in the order doctor shows them."""
    v = view or HostView()
    data_dir = _existing(settings.data_dir)
    device, no_device = v.block.device_of(data_dir)
    return [
        _qemu(v),
        _accelerator(settings, v),
        _seccomp(settings, v),
        _jail(v),
        *_cgroup_lines(settings, v, data_dir),
        _disk_qemu(settings),
        _data_device(data_dir, device, no_device),
        _reflink(settings, v, data_dir),
        _tun(v),
        _nftables(v),
        _netns_dir(v),
        _userns(v),
        _userfaultfd(v),
    ]


# -- QEMU and the accelerator --------------------------------------------------------------


def _qemu(v: HostView) -> Capability:
    version = v.qemu_version()
    if version == "unknown":
        return Capability(
            "qemu",
            "missing",
            "qemu-system-x86_64 not found or not answering",
            fix="apt install qemu-system-x86",
            stops_vms=True,
        )
    return Capability("qemu", "used", f"qemu-system-x86_64 {version} (machine microvm)")


def _accelerator(settings: Settings, v: HostView) -> Capability:
    info = v.probe_accel(settings)
    if info.name == "kvm" and v.euid() == 0 and not _kvm_for_jailed(v.dev / "kvm"):
        return Capability(
            "accelerator",
            "missing",
            f"kvm ({info.reason}), but {v.dev / 'kvm'} opens for root only",
            effect="no VM starts: each QEMU runs as its own uid (the jail) and cannot open it",
            fix=f"give it a group: `chgrp kvm {v.dev / 'kvm'} && chmod 0660 {v.dev / 'kvm'}` (Debian's udev"
            " rule does), or PAL_ACCEL=tcg (software emulation: many times slower)",
            stops_vms=True,
        )
    if info.name == "kvm" or "forced" in info.reason:  # KVM, or TCG by the operator's choice
        return Capability("accelerator", "used", f"{info.name} ({info.reason})")
    return Capability(
        "accelerator",
        "used",
        f"tcg ({info.reason})",
        effect="VMs run under software emulation: boots, restores and CPU-bound work are many times slower",
        fix="a host with a working /dev/kvm (bare metal, or nested virtualization turned on); "
        "Pal probes it again when the host kernel or QEMU changes",
    )


def _kvm_for_jailed(dev: Path) -> bool:
    """A QEMU jailed as its own uid can open /dev/kvm: world read-write, or through its
    group (which the jail adds to each QEMU's groups: pal/vmm/jail.py)."""
    try:
        st = dev.stat()
    except OSError:
        return False
    return st.st_mode & 0o006 == 0o006 or (st.st_mode & 0o060 == 0o060 and st.st_gid != 0)


def _seccomp(settings: Settings, v: HostView) -> Capability:
    if not settings.seccomp:
        return Capability("seccomp", "off", SECCOMP_OPT_OUT, effect=SECCOMP_OPT_OUT_LOSS)
    if not v.qemu_sandbox():
        return Capability(
            "seccomp",
            "missing",
            "this QEMU was built without -sandbox (seccomp)",
            effect="no VM starts without its syscall filter",
            fix=f"install a QEMU built with seccomp (Debian's is), or set {SECCOMP_OPT_OUT}"
            f" ({SECCOMP_OPT_OUT_LOSS})",
            stops_vms=True,
        )
    return Capability("seccomp", "used", "QEMU's -sandbox: set*id, spawn, resource control, old calls denied")


def _jail(v: HostView) -> Capability:
    uid = v.euid()
    if uid == 0:
        what = "each QEMU as its own unprivileged uid, its files as descriptors, a minimal environment"
        return Capability("jail", "used", what)
    return Capability(
        "jail",
        "missing",
        f"Pal runs as uid {uid}, so every QEMU runs as it",
        effect="VMs are not kept apart by uid: a taken-over QEMU can reach the others' files and memory",
        fix="run Pal as root (it drops each QEMU to a uid of its own)",
    )


# -- cgroups: the required limits, IO weight, the kernel's disk throttle ----------------------

_REQUIRED = {
    "cpu": ("cpu limit", "a VM's QEMU can take every host CPU"),
    "memory": ("memory limit", "a VM's QEMU can grow until the host's OOM killer picks a victim"),
    "pids": ("pids limit", "a taken-over QEMU can make threads until the host runs out"),
}
_CGROUP_FIX = {
    "v1": "mount the controller (`mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}`)",
    "v2": "delegate it to Pal's cgroup: run Pal in a service with Delegate=yes, or"
    " `systemd-run --scope -p Delegate=yes pal up`",
}


def _cgroup_lines(settings: Settings, v: HostView, data_dir: Path) -> list[Capability]:
    if not settings.cgroups:
        off = Capability("cgroups", "off", cgroups.OPT_OUT, effect=cgroups.OPT_OUT_LOSS)
        return [off, *(Capability(n, "off", cgroups.OPT_OUT, effect=e) for n, e in _REQUIRED.values())]
    try:
        host = v.discover_cgroups()
        cg = cgroups.probe(host, _default_disk(settings), data_dir)
    except Unavailable as exc:
        return _cgroups_unavailable(v, exc)
    ctrls = ", ".join(host.parents)
    lines = [
        Capability(
            "cgroups", "used", f"{host.version} ({ctrls}): each VM's QEMU in a cgroup of its own, under Pal's"
        )
    ]
    for key, (name, _) in _REQUIRED.items():
        lines.append(Capability(name, "used", cg.applied[key]))
    lines.append(_io_weight(host, cg))
    lines.append(_disk_kernel(host, cg, settings))
    lines.append(
        Capability("cpuset", "not needed", "vCPUs run on any host CPU, bounded by each VM's CPU limit")
    )
    return lines


def _cgroups_unavailable(v: HostView, exc: Unavailable) -> list[Capability]:
    """Discovery failed: the reason, and which required controller is there."""
    version = "v2" if (v.cgroup_root / "cgroup.controllers").exists() else "v1"
    have = _controllers(v, version)
    lines = [
        Capability(
            "cgroups",
            "missing",
            exc.message.split("; see `pal doctor`")[0],
            effect="no VM starts: its CPU, memory and pids limits cannot be made",
            fix=f"see the lines below, or set {cgroups.OPT_OUT} ({cgroups.OPT_OUT_LOSS})",
            stops_vms=True,
        )
    ]
    for key, (name, effect) in _REQUIRED.items():
        if key in have:
            lines.append(Capability(name, "used", f"the {key} controller is there"))
        else:
            fix = _CGROUP_FIX[version].format(c=key)
            lines.append(
                Capability(name, "missing", f"no {key} controller", effect=effect, fix=fix, stops_vms=True)
            )
    return lines


def _controllers(v: HostView, version: str) -> set[str]:
    try:
        own = cgroups.own_paths(v.proc_self_cgroup.read_text())
    except OSError:
        return set()
    if version == "v2":
        base = v.cgroup_root / own.get("", "/").lstrip("/")
        try:
            return set((base / "cgroup.controllers").read_text().split())
        except OSError:
            return set()
    return {c for c in own if c and (v.cgroup_root / c).exists()}


def _io_weight(host: CgroupHost, cg: cgroups.VmCgroup) -> Capability:
    name = "io weight"
    if cgroups.IO_WEIGHT in cg.applied:
        return Capability(
            name, "used", f"{cg.applied[cgroups.IO_WEIGHT]}: 100 per vCPU, a share of the disk's time"
        )
    why = cg.skipped.get(cgroups.IO_WEIGHT, "not applied")
    if host.version == "v1" and "loop" in why:
        fix = "put the data dir on a disk (or partition) of its own with XFS reflink=1, not on the loop image"
    elif host.version == "v2":
        fix = (
            "a kernel with BFQ (`modprobe bfq`, then `echo bfq > /sys/block/<disk>/queue/scheduler`), or"
            " blk-iocost (`echo '<maj:min> enable=1' > /sys/fs/cgroup/io.cost.qos`)"
        )
    else:
        fix = "a kernel with BFQ: `modprobe bfq`, then `echo bfq > /sys/block/<disk>/queue/scheduler`"
    return Capability(
        name,
        "missing",
        why,
        effect="under contention the disk is shared by arrival, not by VM size; the disk throttle"
        " still bounds each VM",
        fix=fix,
    )


def _disk_kernel(host: CgroupHost, cg: cgroups.VmCgroup, settings: Settings) -> Capability:
    name = "disk throttle (kernel)"
    if cgroups.DISK_KERNEL in cg.applied:
        scope = (
            "bounds all of a QEMU's I/O, its page-cache writeback too"
            if host.version == "v2"
            else "bounds what a QEMU submits itself (reads, direct and synchronous writes); cgroup v1"
            " charges page-cache writeback to no one, QEMU's throttle bounds that"
        )
        return Capability(name, "used", f"{cg.applied[cgroups.DISK_KERNEL]}: {scope}")
    if not _default_disk(settings):
        return Capability(name, "off", "PAL_DISK_* are off and a spec may ask none", effect=_NO_DISK_LIMIT)
    return Capability(
        name,
        "missing",
        cg.skipped.get(cgroups.DISK_KERNEL, "not applied"),
        effect="a taken-over QEMU is not bounded by the kernel on the disk; QEMU's own throttle still"
        " bounds every guest",
        fix="a kernel with blk-throttle (CONFIG_BLK_DEV_THROTTLING) and the blkio (v1) or io (v2)"
        " controller for Pal's cgroup",
    )


_NO_DISK_LIMIT = "one VM writing as fast as it can takes the disk from the others"


def _default_disk(settings: Settings) -> DiskLimits:
    return DiskLimits(settings.disk_read_mibps, settings.disk_write_mibps, settings.disk_iops)


def _disk_qemu(settings: Settings) -> Capability:
    name = "disk throttle (QEMU)"
    disk = _default_disk(settings)
    if not disk:
        return Capability(
            name,
            "off",
            "PAL_DISK_READ_MIBPS, PAL_DISK_WRITE_MIBPS and PAL_DISK_IOPS are off",
            effect=_NO_DISK_LIMIT + " (unless its spec asks limits.disk*)",
        )
    return Capability(
        name, "used", f"{disk.describe()} per VM unless its spec asks otherwise (PAL_DISK_*), on every host"
    )


# -- storage ---------------------------------------------------------------------------------


def _data_device(data_dir: Path, device: DataDevice | None, why: str) -> Capability:
    if device is None:
        return Capability(
            "data dir device",
            "missing",
            f"{data_dir}: {why}",
            effect="no kernel disk throttle or IO weight (QEMU's throttle still holds)",
            fix="a data dir on a block device's file system (XFS reflink=1 or btrfs)",
        )
    return Capability("data dir device", "used", f"{data_dir} on {device.describe()}")


def _reflink(settings: Settings, v: HostView, data_dir: Path) -> Capability:
    if v.reflink(data_dir):
        return Capability("reflink", "used", f"yes: snapshots and VM disks are reflink clones ({data_dir})")
    return Capability(
        "reflink",
        "missing",
        f"{data_dir} cannot reflink",
        effect="VM disks are qcow2 overlays and RAM is copied: pause, resume and fork are slower",
        fix="put the data dir on XFS (reflink=1) or btrfs; `pal up` makes a loop-mounted XFS image"
        " there when the data dir is empty",
    )


# -- network ---------------------------------------------------------------------------------


def _tun(v: HostView) -> Capability:
    if (v.dev / "net" / "tun").exists():
        return Capability("tun", "used", "/dev/net/tun: each VM's NIC is a tap in its own network namespace")
    return Capability(
        "tun",
        "missing",
        "/dev/net/tun is absent",
        effect="no VM starts (its NIC cannot be made)",
        fix="`modprobe tun`",
        stops_vms=True,
    )


def _nftables(v: HostView) -> Capability:
    try:
        v.nft_available()
    except Unavailable as exc:
        return Capability(
            "nftables",
            "missing",
            exc.message,
            effect="no VM starts (its namespace's rules cannot be set)",
            fix="apt install libnftables1",
            stops_vms=True,
        )
    return Capability("nftables", "used", "libnftables: each VM's traffic goes only to the egress gateway")


def _netns_dir(v: HostView) -> Capability:
    d = v.netns_dir
    mounted = _is_mount(v.mountinfo, d)
    if mounted:
        return Capability("/run/netns", "used", f"{d} is a mount point: VM namespaces are kept there")
    parent = _existing(d)
    if not v.writable(parent):
        return Capability(
            "/run/netns",
            "missing",
            f"{parent} is not writable",
            effect="no VM starts (no network namespace)",
            fix=f"a writable {d.parent} (tmpfs)",
            stops_vms=True,
        )
    return Capability(
        "/run/netns", "used", f"{d} becomes a shared mount point at the first VM (as `ip netns add` does)"
    )


def _is_mount(mountinfo: Path, d: Path) -> bool:
    try:
        text = mountinfo.read_text()
    except OSError:
        return False
    return any(len(p := line.split()) > 4 and p[4] == str(d) for line in text.splitlines())


# -- what Pal does not need --------------------------------------------------------------------


def _sysctl(v: HostView, name: str) -> str:
    try:
        return (v.proc_sys / name).read_text().strip()
    except OSError:
        return "absent"


def _userns(v: HostView) -> Capability:
    value = _sysctl(v, "user/max_user_namespaces")
    return Capability(
        "user namespaces",
        "not needed",
        f"user.max_user_namespaces={value}: each QEMU runs as its own unprivileged uid, no user namespace",
    )


def _userfaultfd(v: HostView) -> Capability:
    value = _sysctl(v, "vm/unprivileged_userfaultfd")
    return Capability(
        "userfaultfd",
        "not needed",
        f"vm.unprivileged_userfaultfd={value}: restores map snapshot memory copy-on-write (MAP_PRIVATE)",
    )
