"""The QEMU microvm command line for one VM, from a :class:`VmSpec`.

Boot and restore use the same function so the device set always matches (a migration
stream only loads into an identical machine); restore adds ``-incoming defer`` and maps a
different memory file. Files and sockets are named through a :class:`Handoff` (descriptors
QEMU inherits), never by their paths in the data dir: QEMU runs jailed (jail.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pal.errors import Unavailable
from pal.vmm.accel import accel_args
from pal.vmm.disk_limits import DRIVE, DiskLimits
from pal.vmm.handoff import Handoff
from pal.vmm.versions import QEMU_BINARY, qemu_supports_sandbox

# Kernel args measured on the TCG hosts Pal runs on. Under TCG, tsc_early_khz and lpj are
# required (without them boots hang in timer calibration); they are harmless on KVM.
BASE_KERNEL_ARGS = (
    "quiet loglevel=0 panic=-1 nokaslr mitigations=off tsc=reliable no_timer_check "
    "random.trust_cpu=on cryptomgr.notests i8042.noaux i8042.nokbd i8042.nopnp 8250.nr_uarts=0 "
    "console=hvc0"
)
DEFAULT_TSC_KHZ = 2_000_000


class BootImage(Protocol):
    """The guest files a VM boots from; ``pal.images.paths.ImagePaths`` is one."""

    @property
    def kernel(self) -> Path: ...  # uncompressed PVH vmlinux

    @property
    def initrd(self) -> Path: ...

    @property
    def rootfs(self) -> Path: ...  # raw ext4; cloned per VM, never opened by QEMU directly


@dataclass(frozen=True)
class ImageFiles:
    """A plain :class:`BootImage` (tests, tools): the three files of an image directory."""

    kernel: Path
    initrd: Path
    rootfs: Path

    @classmethod
    def from_dir(cls, image_dir: Path) -> ImageFiles:
        d = Path(image_dir)
        return cls(kernel=d / "vmlinux", initrd=d / "initrd.img", rootfs=d / "rootfs.ext4")


@dataclass
class VmSpec:
    vm_id: str
    vm_dir: Path
    image: BootImage
    vcpus: int
    memory_mib: int
    disk_path: Path  # per-VM writable disk (already cloned by the caller)
    disk_format: str = "raw"  # "raw" | "qcow2" (see disks.disk_format_for)
    config_drive: Path | None = None  # read-only /dev/vdb
    accel: str = "tcg"  # "kvm" | "tcg"
    extra_kernel_args: str = ""
    binary: str = QEMU_BINARY
    run_as: tuple[int, int] | None = None  # (uid, gid) QEMU is exec'd as; see jail.py
    groups: tuple[int, ...] = ()  # supplementary groups (a shared RAM file's; see jail.py)
    cgroup_limits: bool = True  # host limits required (PAL_CGROUPS); see cgroups.py
    seccomp: bool = True  # QEMU's seccomp filter required (PAL_SECCOMP); see seccomp_args
    disk_limits: DiskLimits = field(default_factory=DiskLimits)  # QEMU's and the kernel's
    # The NIC's backend: an open tap descriptor QEMU inherits (the manager made it in the
    # VM's network namespace), or None for a NIC wired to nothing (VMM-level tools). The
    # NIC itself is always there: a snapshot only loads into an identical machine.
    net_fd: int | None = None
    nic: bool = True  # False only to restore a snapshot taken before VMs had a NIC
    # A virtio-balloon with free page reporting (the guest gives back what it frees):
    # False only to restore a snapshot taken before VMs had one.
    balloon: bool = True
    # What its host resources are named by (QEMU's -name, its cgroup): the manager's slot
    # of the VM (pal/manager/slots.py), or the vm id when none is given.
    slot: str = ""

    @property
    def host_id(self) -> str:
        return self.slot or self.vm_id

    @property
    def qmp_socket(self) -> Path:
        return self.vm_dir / "qmp.sock"

    @property
    def agent_socket(self) -> Path:
        return self.vm_dir / "agent.sock"

    @property
    def log_path(self) -> Path:
        return self.vm_dir / "qemu.log"

    @property
    def pid_path(self) -> Path:
        """Written by the manager right after the exec (QEMU itself writes no pid file)."""
        return self.vm_dir / "qemu.pid"

    @property
    def mem_path(self) -> Path:
        """The VM's own RAM file (share=on); a private restore maps the snapshot's instead."""
        return self.vm_dir / "mem"


SECCOMP_OPT_OUT = "PAL_SECCOMP=off"
SECCOMP_OPT_OUT_LOSS = (
    "QEMU then runs without its syscall filter: a guest that takes over its QEMU reaches the whole kernel API"
)


def seccomp_args(spec: VmSpec) -> list[str]:
    """QEMU's seccomp filter. Fail closed: a QEMU built without ``-sandbox`` runs no VM
    (503) unless the operator opted out (``PAL_SECCOMP=off``: then no filter at all)."""
    if not spec.seccomp:
        return []
    if not qemu_supports_sandbox(spec.binary):
        raise Unavailable(
            f"{spec.binary} has no -sandbox (it was built without seccomp): no VM starts without its "
            f"syscall filter; install a QEMU with seccomp, or set {SECCOMP_OPT_OUT} ({SECCOMP_OPT_OUT_LOSS});"
            " see `pal doctor`"
        )
    # QEMU is exec'd already as its own uid (no -runas), so set*id can be denied too;
    # migration goes through descriptors we pass, so it never needs to spawn.
    return ["-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]


@functools.cache
def host_tsc_khz() -> int:
    """The host TSC frequency in kHz (TCG's guest TSC ticks at the host's rate)."""
    # /proc/cpuinfo's "cpu MHz" is the TSC rate on constant_tsc hosts without cpufreq
    # scaling (VMs, servers); cached because it is read on every spawn.
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return DEFAULT_TSC_KHZ
    m = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.MULTILINE)
    if not m:
        return DEFAULT_TSC_KHZ
    return int(float(m.group(1)) * 1000)


def kernel_args(extra: str = "") -> str:
    khz = host_tsc_khz()
    # lpj = loops per jiffy at HZ=250: khz * 1000 / 250.
    args = f"{BASE_KERNEL_ARGS} tsc_early_khz={khz} lpj={4 * khz}"
    return f"{args} {extra}".strip()


def build_argv(
    spec: VmSpec, h: Handoff, *, mem_path: Path, mem_share: bool, incoming: bool = False
) -> list[str]:
    """argv for QEMU, opening what it needs through ``h``. ``mem_share=False`` maps
    ``mem_path`` MAP_PRIVATE (copy-on-write)."""
    mem = f"{spec.memory_mib}M"
    share = "on" if mem_share else "off"
    # Opaque labels and the -name keep the VM's paths and id visible in `ps` (and let a
    # restarted manager recognise its QEMUs), though QEMU opens none of them.
    argv = [
        spec.binary,
        # -no-reboot: a guest that panics (harness died, panic=-1) makes QEMU exit, which
        # the manager sees, instead of rebooting the guest in a loop.
        *("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"),
        *("-serial", "none", "-monitor", "none", "-parallel", "none"),
        "-name",
        f"pal-{spec.host_id},process=pal-{spec.host_id}",
        "-object",
        f"memory-backend-file,id=mem,size={mem},mem-path={h.file(mem_path)},share={share}",
        "-M",
        "microvm,x-option-roms=off,isa-serial=off,pit=on,rtc=on,memory-backend=mem",
        *("-m", mem, "-smp", str(spec.vcpus)),
        *accel_args(spec.accel),
        *("-kernel", h.file(spec.image.kernel), "-initrd", h.file(spec.image.initrd)),
        *("-append", kernel_args(spec.extra_kernel_args)),
        *("-device", "virtio-serial-device,max_ports=2"),
        *("-chardev", f"socket,id=agent,fd={h.listener(spec.agent_socket)},server=on,wait=off"),
        *("-device", "virtserialport,chardev=agent,name=agent"),
    ]
    root = h.block_device(spec.disk_path, readonly=False)
    cfg = h.block_device(spec.config_drive, readonly=True) if spec.config_drive is not None else None
    argv += h.add_fd_args
    argv += [
        # cache=unsafe only skips fsync to the host disk: every guest write still reaches
        # the host file (page cache), and QMP `stop` drains and flushes all block devices
        # (qcow2 metadata included) before we reflink the disk, so a snapshot is consistent.
        # Durability across a host crash is not promised for a live VM's disk.
        # file.locking=off: the fd set's two descriptors are separate open files (see
        # handoff.py); the disk is this VM's alone.
        # The disk limits (disk_limits.py) are the drive's throttle from its first request.
        "-drive",
        f"id={DRIVE},if=none,file={root},format={spec.disk_format},cache=unsafe,aio=threads,"
        f"file.locking=off{spec.disk_limits.drive_options()}",
        *("-device", f"virtio-blk-device,drive={DRIVE}"),
    ]
    if spec.nic:
        # vhost=off: the in-kernel vhost worker would need /dev/vhost-net and run outside
        # QEMU's jail; under TCG the guest, not the backend, bounds throughput anyway.
        backend = "hubport,id=n0,hubid=0"  # wired to nothing
        if spec.net_fd is not None:
            backend = f"tap,id=n0,fd={h.fd(spec.net_fd)},vhost=off"
        argv += ["-netdev", backend, "-device", "virtio-net-device,netdev=n0"]
    if cfg is not None:
        argv += [
            "-drive",
            f"id=cfg,if=none,file={cfg},format=raw,readonly=on,file.locking=off",
            *("-device", "virtio-blk-device,drive=cfg"),
        ]
    if spec.balloon:
        # Last, so the devices before it keep their virtio-mmio slots. The balloon is never
        # inflated: it is there for free page reporting, whose ranges QEMU discards from
        # the RAM backend (a hole punched in a share=on file: docs/lifecycle.md, "Memory
        # a guest frees").
        argv += ["-device", "virtio-balloon-device,free-page-reporting=on"]
    # No -device vmgenid: QEMU 7.2 takes the device on microvm but never describes it to
    # the guest (microvm's ACPI tables have no VMGENID device; only pc/q35 build one), and
    # the Debian cloud kernel has no CONFIG_VMGENID either. The harness reseeds the kernel
    # RNG from `identify`'s host seed and forces a CRNG reseed (RNDRESEEDCRNG) after every
    # restore, fork and pool claim instead (docs/security.md, "What restored VMs share").
    qmp = h.listener(spec.qmp_socket)
    argv += ["-chardev", f"socket,id=qmp,fd={qmp},server=on,wait=off", "-mon", "chardev=qmp,mode=control"]
    argv += seccomp_args(spec)
    if incoming:
        argv += ["-incoming", "defer"]
    return argv
