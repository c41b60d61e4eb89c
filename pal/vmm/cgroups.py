"""Host limits for each QEMU, through cgroups (v1 or v2): CPU quota, memory, pids, IO weight.

The guest already sees only its vCPUs and RAM; these limits protect the *host* and the other
VMs from a QEMU that misbehaves or was taken over: a runaway translation cache, a thread
bomb, a disk hog. Each VM gets ``<Pal's own cgroup>/pal/<vm_id>`` (one directory per
controller on v1, one on v2), nested below the cgroup Pal itself runs in, so Pal never
escapes limits its operator set on it.

Fail closed: a VM's cgroup is made, with every limit written, before its QEMU is exec'd,
and the QEMU is moved into it before it can run guest code (qemu.py); when any of that is
impossible the VM does not start (503). ``PAL_CGROUPS=off`` is the operator's explicit
opt-out: VMs then run without host limits, and the log and `pal doctor` say so.

cgroup v2: the controllers must be enabled in ``cgroup.subtree_control`` at every level
above a VM's cgroup, and a cgroup that holds processes cannot enable them for its children
(the "no internal processes" rule). When Pal's own cgroup holds only Pal (a service with
``Delegate=yes``), Pal moves itself into a leaf ``<own>/pal-manager`` first; when it shares
it with other processes (a login shell's scope) it refuses and says how to run it.

The IO weight is written on both versions, but only a scheduler that implements weights
honours it (BFQ; on v2 also blk-iocost once enabled for the device): `pal doctor` names the
data dir's device scheduler.
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
IO_WEIGHT = 100  # the same share for every VM (and the default of everything else)
V1_CONTROLLERS = ("cpu", "memory", "pids", "blkio")
V2_CONTROLLERS = ("cpu", "memory", "pids", "io")
UNIFIED = "unified"
MANAGER_LEAF = "pal-manager"
# Knobs that set an IO weight, most specific first; which exist depends on the kernel.
V1_IO_KNOBS = ("blkio.bfq.weight", "blkio.weight")
V2_IO_KNOBS = ("io.weight", "io.bfq.weight")
OPT_OUT = "PAL_CGROUPS=off"


@dataclass(frozen=True)
class Limits:
    cpu_quota_us: int
    memory_bytes: int
    pids: int = PIDS_MAX
    io_weight: int = IO_WEIGHT

    @classmethod
    def for_vm(cls, vcpus: int, memory_mib: int) -> Limits:
        return cls(
            cpu_quota_us=int((vcpus + EXTRA_CPU_FRACTION) * CFS_PERIOD_US),
            memory_bytes=(memory_mib + QEMU_OVERHEAD_MIB) * 1024 * 1024,
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
    return Unavailable(f"host limits (cgroups) cannot be applied: {why}; see `pal doctor`, or set {OPT_OUT}")


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


@dataclass
class CgroupHost:
    """Where this node's VM cgroups go: ``parents`` maps each controller (v1) or
    "unified" (v2) to the ``pal`` directory under Pal's own cgroup."""

    version: str  # "v1" | "v2"
    parents: dict[str, Path]
    fs: CgroupFs = field(default_factory=CgroupFs, repr=False)

    @classmethod
    def discover(
        cls, root: Path = ROOT, proc_self: Path = PROC_SELF_CGROUP, fs: CgroupFs | None = None
    ) -> CgroupHost:
        """Find (v2: prepare) the parent directories; Unavailable with the reason if none."""
        fs = fs or CgroupFs()
        try:
            own = own_paths(fs.read(proc_self))
        except OSError as exc:
            raise _unavailable(f"cannot read {proc_self}: {exc}") from exc
        if fs.exists(root / "cgroup.controllers"):
            return cls._discover_v2(root, own.get("", "/"), fs)
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
        # cpuacct only counts (CPU time for the per-VM metrics); it limits nothing.
        if "cpuacct" in own and fs.exists(root / "cpuacct" / "cpuacct.usage"):
            parents["cpuacct"] = root / "cpuacct" / own["cpuacct"].lstrip("/") / "pal"
        return cls("v1", parents, fs)

    @classmethod
    def _discover_v2(cls, root: Path, own: str, fs: CgroupFs) -> CgroupHost:
        base = root / own.lstrip("/")
        available = set(fs.read(base / "cgroup.controllers").split())
        missing = [c for c in V2_CONTROLLERS if c not in available]
        if missing:
            raise _unavailable(f"cgroup v2 controller(s) {', '.join(missing)} not delegated to {base}")
        enable = " ".join(f"+{c}" for c in V2_CONTROLLERS)
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
        return cls("v2", {UNIFIED: pal}, fs)

    def dirs(self, vm_id: str) -> dict[str, Path]:
        return {ctrl: parent / vm_id for ctrl, parent in self.parents.items()}

    def create(self, vm_id: str, limits: Limits) -> VmCgroup:
        """The VM's cgroup(s) with every limit written; Unavailable (nothing left) if not."""
        cg = VmCgroup(vm_id, self.dirs(vm_id), fs=self.fs)
        try:
            for d in cg.dirs.values():
                self.fs.mkdir(d.parent)
                self.fs.mkdir(d)
            for limit, (d, knob, value) in self._knobs(cg, limits).items():
                self.fs.write(d / knob, value)
                cg.applied[limit] = f"{knob}={value}"
        except (OSError, Unavailable) as exc:
            cg.remove(timeout_s=0.5)
            if isinstance(exc, Unavailable):
                raise
            raise _unavailable(f"VM {vm_id}: {exc}") from exc
        return cg

    def _knobs(self, cg: VmCgroup, limits: Limits) -> dict[str, tuple[Path, str, str]]:
        """limit -> (directory, knob file, value), in the order they are written."""
        d = cg.dirs
        if self.version == "v2":
            u = d[UNIFIED]
            knobs = {
                "cpu": (u, "cpu.max", f"{limits.cpu_quota_us} {CFS_PERIOD_US}"),
                "memory": (u, "memory.max", str(limits.memory_bytes)),
                "pids": (u, "pids.max", str(limits.pids)),
            }
            io = self._io_knob(u, V2_IO_KNOBS)
            if io:
                knobs["io"] = (u, io, f"default {limits.io_weight}")
            return knobs
        knobs = {
            "cpu period": (d["cpu"], "cpu.cfs_period_us", str(CFS_PERIOD_US)),
            "cpu": (d["cpu"], "cpu.cfs_quota_us", str(limits.cpu_quota_us)),
            "memory": (d["memory"], "memory.limit_in_bytes", str(limits.memory_bytes)),
            "pids": (d["pids"], "pids.max", str(limits.pids)),
        }
        io = self._io_knob(d["blkio"], V1_IO_KNOBS)
        if io:
            knobs["io"] = (d["blkio"], io, str(limits.io_weight))
        return knobs

    def _io_knob(self, d: Path, knobs: tuple[str, ...]) -> str | None:
        """The IO weight knob, or None where the kernel has no weight-aware scheduler (the
        weight is a refinement, not a protection: it is skipped there)."""
        for knob in knobs:
            if self.fs.exists(d / knob):
                return knob
        return None

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


def create_for(vm_id: str, vcpus: int, memory_mib: int) -> VmCgroup:
    """The cgroup a new QEMU goes into (Unavailable: the VM must not start)."""
    return host().create(vm_id, Limits.for_vm(vcpus, memory_mib))


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


# ------------------------------------------------------------------------- pal doctor


def _block_scheduler(path: Path, depth: int = 0) -> str:
    """``<device>: <I/O scheduler>`` of the block device holding ``path`` (through loops)."""
    try:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    except OSError:
        return "unknown device"
    if (dev / "partition").exists():
        dev = dev.parent
    backing = dev / "loop" / "backing_file"
    if backing.exists() and depth < 3:
        with contextlib.suppress(OSError):
            inner = _block_scheduler(Path(backing.read_text().strip()), depth + 1)
            return f"{dev.name} (loop) on {inner}"
    try:
        text = (dev / "queue" / "scheduler").read_text()
    except OSError:
        return f"{dev.name}: scheduler unknown"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    return f"{dev.name}: {chosen}"


def describe(enabled: bool, data_dir: Path) -> str:
    """What `pal doctor` shows: which limits really hold, found by making a probe cgroup."""
    if not enabled:
        return f"off ({OPT_OUT}): VMs run without host CPU, memory, pids or IO limits"
    try:
        h = host()
        probe = h.create(f"doctor-probe-{os.getpid()}", Limits.for_vm(1, 64))
    except Unavailable as exc:
        return f"UNAVAILABLE: {exc.message}; VMs will not start"
    try:
        knobs = {k: v for k, v in probe.applied.items() if k != "cpu period"}
    finally:
        probe.remove(timeout_s=0.5)
    io = knobs.pop("io", "")
    held = ", ".join(f"{k} ({v})" for k, v in knobs.items())
    sched = _block_scheduler(data_dir)
    effect = "in effect" if sched.endswith(": bfq") else "NO effect here (needs bfq, or io.cost on v2)"
    return f"{h.version}: {held} hold per VM; io weight ({io}) is set, {effect}: data dir on {sched}"
