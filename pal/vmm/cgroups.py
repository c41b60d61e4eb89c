"""Host limits for each QEMU, through cgroups (v1 or v2): CPU quota, memory, pids (required),
IO weight and disk throttle (where the host has them).

The guest already sees only its vCPUs and RAM; these limits protect the *host* and the other
VMs from a QEMU that misbehaves or was taken over: a runaway translation cache, a thread
bomb, a disk hog. Each VM gets ``<Pal's own cgroup>/pal/<slot>`` (one directory per
controller on v1, one on v2), nested below the cgroup Pal itself runs in, so Pal never
escapes limits its operator set on it.

Fail closed where a limit protects: a VM's cgroup is made, with its CPU, memory and pids
limits written, before its QEMU is exec'd, and the QEMU is moved into it before it can run
guest code (qemu.py); when any of that is impossible the VM does not start (503).
``PAL_CGROUPS=off`` is the operator's explicit opt-out: VMs then run without any of these
limits, and the log and `pal doctor` say so.

Applied where the host has them, skipped (with the reason, in the VM's ``limitsApplied``,
the start log and `pal doctor`) where it does not, because a VM is safe without them:

- the **IO weight**: a share of the disk's time under contention, honoured only by BFQ (and
  by blk-iocost on v2) on the disk at the bottom of the data dir's device chain
  (blockdev.py). Most cloud kernels have neither, and a weight only refines what the disk
  throttle already bounds. It is 100 per vCPU, as the CPU quota is per vCPU: a 1-vCPU VM
  weighs what any other cgroup of the host does by default, a 4-vCPU VM, which placement
  counts as four times the machine, gets four times the share.
- the **disk throttle** (bandwidth and IOPS) on the device QEMU's I/O is submitted to:
  the kernel's half of the disk limits (disk_limits.py says why QEMU holds them too).

cgroup v2: the controllers must be enabled in ``cgroup.subtree_control`` at every level
above a VM's cgroup, and a cgroup that holds processes cannot enable them for its children
(the "no internal processes" rule). When Pal's own cgroup holds only Pal (a service with
``Delegate=yes``), Pal moves itself into a leaf ``<own>/pal-manager`` first; when it shares
it with other processes (a login shell's scope) it refuses and says how to run it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pal.errors import Unavailable
from pal.vmm.blockdev import BlockHost, DataDevice
from pal.vmm.disk_limits import DiskLimits

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CFS_PERIOD_US = 100_000
# QEMU's own memory next to guest RAM: the TCG translation cache (64 MiB), device state,
# I/O buffers, the QMP and chardev threads. Generous: hitting it means QEMU is broken.
QEMU_OVERHEAD_MIB = 384
# vCPU threads get vcpus x 100 % of a core; half a core more for QEMU's main loop and I/O.
EXTRA_CPU_FRACTION = 0.5
# QEMU's threads: main loop, one per vCPU, RCU, up to 64 block I/O workers, chardevs.
# A QEMU cannot fork (seccomp spawn=deny); this bounds the threads an escaped one can make.
PIDS_MAX = 256
IO_WEIGHT_PER_VCPU = 100  # the kernel's default weight is 100: one vCPU weighs one cgroup
# The required controllers (fail closed) and the optional one that carries IO weight and
# disk throttle; cpuacct (v1) only counts CPU time for the metrics.
V1_CONTROLLERS = ("cpu", "memory", "pids")
V2_CONTROLLERS = ("cpu", "memory", "pids")
V1_IO, V2_IO = "blkio", "io"
UNIFIED = "unified"
MANAGER_LEAF = "pal-manager"
# Knobs that set an IO weight, most specific first, with their range and the schedulers
# that honour them ("iocost": blk-iocost enabled for the device in the root's io.cost.qos).
V1_IO_KNOBS = (("blkio.bfq.weight", 1000, ("bfq",)), ("blkio.weight", 1000, ("bfq", "cfq")))
V2_IO_KNOBS = (("io.bfq.weight", 1000, ("bfq",)), ("io.weight", 10000, ("iocost",)))
V1_THROTTLE = "blkio.throttle.read_bps_device"
V2_THROTTLE = "io.max"
OPT_OUT = "PAL_CGROUPS=off"
OPT_OUT_LOSS = (
    "VMs then run with no host CPU, memory, pids or kernel disk limits: one runaway or"
    " taken-over QEMU can take the host's CPU, memory and threads from every other VM"
)
# Names of the limits in a VM's report (limitsApplied) and `pal doctor`.
IO_WEIGHT = "ioWeight"
DISK_KERNEL = "diskKernel"


@dataclass(frozen=True)
class Limits:
    cpu_quota_us: int
    memory_bytes: int
    pids: int = PIDS_MAX
    io_weight: int = IO_WEIGHT_PER_VCPU
    disk: DiskLimits = field(default_factory=DiskLimits)

    @classmethod
    def for_vm(cls, vcpus: int, memory_mib: int, disk: DiskLimits | None = None) -> Limits:
        return cls(
            cpu_quota_us=int((vcpus + EXTRA_CPU_FRACTION) * CFS_PERIOD_US),
            memory_bytes=(memory_mib + QEMU_OVERHEAD_MIB) * 1024 * 1024,
            io_weight=IO_WEIGHT_PER_VCPU * vcpus,
            disk=disk or DiskLimits(),
        )


class CgroupFs:
    """The few file operations cgroups need (a test replaces it with a fake cgroupfs)."""

    def read(self, path: Path) -> str:
        return path.read_text()

    def write(self, path: Path, text: str) -> None:
        # cgroupfs creates no files: a missing knob is an error, never a new regular file.
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def mkdir(self, path: Path) -> None:
        path.mkdir(exist_ok=True)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)


def _unavailable(why: str) -> Unavailable:
    return Unavailable(
        f"host limits (cgroups) cannot be applied: {why}; see `pal doctor`, or set {OPT_OUT} ({OPT_OUT_LOSS})"
    )


def own_paths(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> path ("" is the v2 unified hierarchy)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


@dataclass
class VmCgroup:
    vm_id: str
    dirs: dict[str, Path]  # controller (or "unified") -> directory
    applied: dict[str, str] = field(default_factory=dict)  # limit -> "knob=value" written
    skipped: dict[str, str] = field(default_factory=dict)  # limit -> why the host has none
    fs: CgroupFs = field(default_factory=CgroupFs, repr=False)

    def add(self, pid: int) -> None:
        """Move the whole process (all its threads) in; Unavailable if it cannot be."""
        for d in self.dirs.values():
            try:
                self.fs.write(d / "cgroup.procs", str(pid))
            except ProcessLookupError:
                return  # already exited: nothing left to limit (the caller sees the exit)
            except OSError as exc:
                raise _unavailable(f"cannot move QEMU {pid} of {self.vm_id} into {d}: {exc}") from exc

    def cpu_usage_ns(self) -> int | None:
        """CPU time used by every process in the VM's cgroup (v2 cpu.stat, v1 cpuacct)."""
        try:
            if UNIFIED in self.dirs:
                for line in self.fs.read(self.dirs[UNIFIED] / "cpu.stat").splitlines():
                    name, _, value = line.partition(" ")
                    if name == "usage_usec":
                        return int(value) * 1000
                return None
            if "cpuacct" in self.dirs:
                return int(self.fs.read(self.dirs["cpuacct"] / "cpuacct.usage"))
        except (OSError, ValueError):
            return None
        return None

    def remove(self, timeout_s: float = 2.0) -> None:
        """Remove the (empty) cgroups; a just-killed process may take a moment to leave."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs.values():
            while self.fs.exists(d):
                try:
                    self.fs.rmdir(d)
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("cgroup %s still busy; left in place", d)
                        break
                    time.sleep(0.01)


Knob = tuple[Path, str, str]  # (directory, knob file, value)


@dataclass
class CgroupHost:
    """Where this node's VM cgroups go: ``parents`` maps each controller (v1) or
    "unified" (v2) to the ``pal`` directory under Pal's own cgroup; ``no_io`` says why the
    IO controller is not among them (it is optional)."""

    version: str  # "v1" | "v2"
    parents: dict[str, Path]
    fs: CgroupFs = field(default_factory=CgroupFs, repr=False)
    root: Path = ROOT
    no_io: str = ""
    block: BlockHost = field(default_factory=BlockHost, repr=False)

    @classmethod
    def discover(
        cls,
        root: Path = ROOT,
        proc_self: Path = PROC_SELF_CGROUP,
        fs: CgroupFs | None = None,
        block: BlockHost | None = None,
    ) -> CgroupHost:
        """Find (v2: prepare) the parent directories; Unavailable with the reason if none."""
        fs = fs or CgroupFs()
        block = block or BlockHost()
        try:
            own = own_paths(fs.read(proc_self))
        except OSError as exc:
            raise _unavailable(f"cannot read {proc_self}: {exc}") from exc
        if fs.exists(root / "cgroup.controllers"):
            return cls._discover_v2(root, own.get("", "/"), fs, block)
        parents: dict[str, Path] = {}
        missing = []
        for ctrl in V1_CONTROLLERS:
            mount = root / ctrl
            if ctrl not in own or not fs.exists(mount):
                missing.append(ctrl)
                continue
            parents[ctrl] = mount / own[ctrl].lstrip("/") / "pal"
        if missing:
            raise _unavailable(f"cgroup v1 controller(s) {', '.join(missing)} not mounted under {root}")
        no_io = ""
        if V1_IO in own and fs.exists(root / V1_IO):
            parents[V1_IO] = root / V1_IO / own[V1_IO].lstrip("/") / "pal"
        else:
            no_io = f"the cgroup v1 {V1_IO} controller is not mounted under {root}"
        # cpuacct only counts (CPU time for the per-VM metrics); it limits nothing.
        if "cpuacct" in own and fs.exists(root / "cpuacct" / "cpuacct.usage"):
            parents["cpuacct"] = root / "cpuacct" / own["cpuacct"].lstrip("/") / "pal"
        return cls("v1", parents, fs, root, no_io, block)

    @classmethod
    def _discover_v2(cls, root: Path, own: str, fs: CgroupFs, block: BlockHost) -> CgroupHost:
        base = root / own.lstrip("/")
        available = set(fs.read(base / "cgroup.controllers").split())
        missing = [c for c in V2_CONTROLLERS if c not in available]
        if missing:
            raise _unavailable(f"cgroup v2 controller(s) {', '.join(missing)} not delegated to {base}")
        wanted = [*V2_CONTROLLERS, *([V2_IO] if V2_IO in available else [])]
        no_io = "" if V2_IO in available else f"the cgroup v2 {V2_IO} controller is not delegated to {base}"
        enable = " ".join(f"+{c}" for c in wanted)
        try:
            fs.write(base / "cgroup.subtree_control", enable)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise _unavailable(f"cannot enable controllers in {base}: {exc}") from exc
            # Processes in `base` keep it from delegating: if they are only us, step aside.
            procs = {int(p) for p in fs.read(base / "cgroup.procs").split()}
            if procs - {os.getpid()}:
                raise _unavailable(
                    f"Pal shares its cgroup {base} with other processes, so it cannot give VMs "
                    f"cgroups of their own; run it in a delegated cgroup, e.g. "
                    f"`systemd-run --scope -p Delegate=yes pal up`, or a service with Delegate=yes"
                ) from exc
            leaf = base / MANAGER_LEAF
            try:
                fs.mkdir(leaf)
                fs.write(leaf / "cgroup.procs", str(os.getpid()))
                fs.write(base / "cgroup.subtree_control", enable)
            except OSError as exc2:
                raise _unavailable(f"cannot enable controllers in {base}: {exc2}") from exc2
            log.info("cgroup v2: moved Pal into %s so VMs can have cgroups of their own", leaf)
        pal = base / "pal"
        try:
            fs.mkdir(pal)
            fs.write(pal / "cgroup.subtree_control", enable)
        except OSError as exc:
            raise _unavailable(f"cannot prepare {pal}: {exc}") from exc
        return cls("v2", {UNIFIED: pal}, fs, root, no_io, block)

    def dirs(self, vm_id: str) -> dict[str, Path]:
        return {ctrl: parent / vm_id for ctrl, parent in self.parents.items()}

    def create(self, vm_id: str, limits: Limits, disk_dir: Path | None = None) -> VmCgroup:
        """The VM's cgroup(s) with its CPU, memory and pids limits written (Unavailable,
        nothing left, if they cannot be), and its IO weight and disk throttle on the device
        holding ``disk_dir`` where the host has them (else ``skipped`` says why not)."""
        cg = VmCgroup(vm_id, self.dirs(vm_id), fs=self.fs)
        try:
            for d in cg.dirs.values():
                self.fs.mkdir(d.parent)
                self.fs.mkdir(d)
            for limit, (d, knob, value) in self._required(cg, limits).items():
                self.fs.write(d / knob, value)
                cg.applied[limit] = f"{knob}={value}"
        except (OSError, Unavailable) as exc:
            cg.remove(timeout_s=0.5)
            if isinstance(exc, Unavailable):
                raise
            raise _unavailable(f"VM {vm_id}: {exc}") from exc
        if disk_dir is not None:  # None: a QEMU without a disk of its own (tools, tests)
            device, no_device = self.block.device_of(disk_dir)
            self._optional(cg, IO_WEIGHT, self._io_weight(cg, limits.io_weight, device, no_device))
            self._optional(cg, DISK_KERNEL, self._throttle(cg, limits.disk, device, no_device))
        return cg

    def limit_disk(self, cg: VmCgroup, disk: DiskLimits, disk_dir: Path) -> None:
        """New disk limits for a VM that runs already (a claimed pooled VM takes its
        tenant's); skipped as at ``create`` where the host has no throttle."""
        cg.applied.pop(DISK_KERNEL, None)
        cg.skipped.pop(DISK_KERNEL, None)
        device, no_device = self.block.device_of(disk_dir)
        self._optional(cg, DISK_KERNEL, self._throttle(cg, disk, device, no_device, clear=True))

    def _optional(self, cg: VmCgroup, limit: str, plan: tuple[list[Knob], str] | str) -> None:
        """Write an optional limit's knobs (and record its summary), or record why it is
        skipped. A knob the kernel refuses (a device it does not throttle) skips the limit,
        it never stops the VM."""
        if isinstance(plan, str):
            if plan:
                cg.skipped[limit] = plan
            return
        knobs, summary = plan
        try:
            for d, knob, value in knobs:
                self.fs.write(d / knob, value)
        except OSError as exc:
            cg.skipped[limit] = f"the kernel refused {knobs[0][1]}: {exc.strerror or exc}"
            return
        if knobs:
            cg.applied[limit] = summary

    def _required(self, cg: VmCgroup, limits: Limits) -> dict[str, Knob]:
        """limit -> (directory, knob file, value), in the order they are written."""
        d = cg.dirs
        if self.version == "v2":
            u = d[UNIFIED]
            return {
                "cpu": (u, "cpu.max", f"{limits.cpu_quota_us} {CFS_PERIOD_US}"),
                "memory": (u, "memory.max", str(limits.memory_bytes)),
                "pids": (u, "pids.max", str(limits.pids)),
            }
        return {
            "cpu period": (d["cpu"], "cpu.cfs_period_us", str(CFS_PERIOD_US)),
            "cpu": (d["cpu"], "cpu.cfs_quota_us", str(limits.cpu_quota_us)),
            "memory": (d["memory"], "memory.limit_in_bytes", str(limits.memory_bytes)),
            "pids": (d["pids"], "pids.max", str(limits.pids)),
        }

    def _io_dir(self, cg: VmCgroup) -> Path | None:
        if self.no_io:
            return None
        return cg.dirs[UNIFIED] if self.version == "v2" else cg.dirs[V1_IO]

    def _io_weight(
        self, cg: VmCgroup, weight: int, device: DataDevice | None, no_device: str
    ) -> tuple[list[Knob], str] | str:
        """The weight's knob, or why the host has no weight that would work (a knob that
        exists but whose disk's scheduler ignores it is not written: it would claim a
        share nobody gives)."""
        d = self._io_dir(cg)
        if d is None:
            return self.no_io
        knobs = V2_IO_KNOBS if self.version == "v2" else V1_IO_KNOBS
        present = [(k, hi, honoured) for k, hi, honoured in knobs if self.fs.exists(d / k)]
        if not present:
            names = " or ".join(k for k, _, _ in knobs)
            iocost = " and no blk-iocost" if self.version == "v2" else ""
            return f"no IO weight knob ({names}): the kernel has no BFQ{iocost}"
        if device is None:
            return f"no block device under the data dir ({no_device})"
        if self.version == "v1" and device.top.kind == "loop":
            return (
                f"the data dir is on {device.describe()}: below a loop device the I/O is the loop "
                "worker's, which cgroup v1 charges to no VM, so no scheduler sees a VM's weight"
            )
        disk = device.bottom
        have = {disk.scheduler} | ({"iocost"} if self.iocost_enabled(disk.dev) else set())
        for knob, hi, honoured in present:
            if have & set(honoured):
                value = max(1, min(weight, hi))
                text = f"default {value}" if self.version == "v2" else str(value)
                return [(d, knob, text)], f"{knob}={text} ({disk.name}: {disk.scheduler})"
        offered = "/".join(disk.schedulers) or disk.scheduler
        would = "bfq, or blk-iocost enabled in io.cost.qos" if self.version == "v2" else "bfq"
        return (
            f"{disk.name} uses the {disk.scheduler} scheduler, which ignores weights (offered: {offered}; "
            f"{would} would honour them)"
        )

    def iocost_enabled(self, dev: str) -> bool:
        """blk-iocost is on for ``dev`` (v2: the root's io.cost.qos says ``enable=1``)."""
        if self.version != "v2":
            return False
        try:
            text = self.fs.read(self.root / "io.cost.qos")
        except OSError:
            return False
        return any(line.split()[:1] == [dev] and "enable=1" in line.split() for line in text.splitlines())

    def _throttle(
        self, cg: VmCgroup, disk: DiskLimits, device: DataDevice | None, no_device: str, clear: bool = False
    ) -> tuple[list[Knob], str] | str:
        """The throttle's knobs on the device QEMU's I/O is submitted to (blockdev.py), or
        why there is none; ``clear``: unbounded kinds are written as such (a change)."""
        if not disk and not clear:
            return [], ""  # nothing asked: nothing applied, nothing the host lacks
        d = self._io_dir(cg)
        if d is None:
            return self.no_io
        knob = V2_THROTTLE if self.version == "v2" else V1_THROTTLE
        if not self.fs.exists(d / knob):
            return f"no {knob}: the kernel has no blk-throttle (CONFIG_BLK_DEV_THROTTLING)"
        if device is None:
            return f"no block device under the data dir ({no_device})"
        dev = device.top.dev
        family = "io.max" if self.version == "v2" else "blkio.throttle"
        summary = f"{disk.describe()} on {device.top.name} ({dev}, {family})"
        if self.version == "v2":
            vals = {"rbps": disk.read_bps, "wbps": disk.write_bps, "riops": disk.iops, "wiops": disk.iops}
            return [(d, knob, f"{dev} " + " ".join(f"{k}={v or 'max'}" for k, v in vals.items()))], summary
        v1 = {
            "blkio.throttle.read_bps_device": disk.read_bps,
            "blkio.throttle.write_bps_device": disk.write_bps,
            "blkio.throttle.read_iops_device": disk.iops or 0,
            "blkio.throttle.write_iops_device": disk.iops or 0,
        }
        return [(d, k, f"{dev} {v}") for k, v in v1.items() if v or clear], summary

    def existing(self, vm_id: str) -> VmCgroup | None:
        """The cgroup a previous manager made for an adopted VM, if any."""
        dirs = self.dirs(vm_id)
        if not all(self.fs.exists(d) for k, d in dirs.items() if k != "cpuacct"):
            return None
        return VmCgroup(vm_id, {k: d for k, d in dirs.items() if self.fs.exists(d)}, fs=self.fs)


_host: CgroupHost | Unavailable | None = None


def host() -> CgroupHost:
    """This node's cgroup layout, discovered (v2: prepared) once; Unavailable if none."""
    global _host
    if _host is None:
        try:
            _host = CgroupHost.discover()
        except Unavailable as exc:
            _host = exc
    if isinstance(_host, Unavailable):
        raise _host
    return _host


def create_for(vm_id: str, vcpus: int, memory_mib: int, disk: DiskLimits, disk_dir: Path) -> VmCgroup:
    """The cgroup a new QEMU goes into (Unavailable: the VM must not start)."""
    return host().create(vm_id, Limits.for_vm(vcpus, memory_mib, disk), disk_dir)


def existing_for(vm_id: str) -> VmCgroup | None:
    with contextlib.suppress(Unavailable):
        return host().existing(vm_id)
    return None


def remove_leftover(vm_id: str, timeout_s: float = 2.0) -> bool:
    """Remove whatever is left of a VM's cgroups (its QEMU killed by a restarted manager,
    or never started); True if there was something."""
    try:
        h = host()
    except Unavailable:
        return False
    dirs = {k: d for k, d in h.dirs(vm_id).items() if h.fs.exists(d)}
    if dirs:
        VmCgroup(vm_id, dirs, fs=h.fs).remove(timeout_s)
    return bool(dirs)


def report(cg: VmCgroup | None) -> tuple[dict[str, str], dict[str, str]]:
    """(applied, skipped) limits of a VM's cgroup; None: PAL_CGROUPS=off, every one skipped."""
    if cg is None:
        off = f"{OPT_OUT}: {OPT_OUT_LOSS}"
        return {}, {k: off for k in ("cpu", "memory", "pids", IO_WEIGHT, DISK_KERNEL)}
    return {k: v for k, v in cg.applied.items() if k != "cpu period"}, dict(cg.skipped)


def probe(h: CgroupHost, disk: DiskLimits, disk_dir: Path) -> VmCgroup:
    """What a 1-vCPU VM's cgroup gets on this host, found by making one and removing it
    (`pal doctor`, the start log): the same code a VM's goes through."""
    cg = h.create(f"probe-{os.getpid()}", Limits.for_vm(1, 64, disk), disk_dir)
    cg.remove(timeout_s=0.5)
    return cg
