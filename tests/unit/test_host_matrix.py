"""The hosts users run Pal on, as fake /sys/fs/cgroup and /sys/block trees (tests/hostfakes.py):
for each, what a VM's cgroup gets (applied, skipped and why) and what `pal doctor` says
(pal/manager/hostcaps.py: one line per capability, and a failure only for what stops VMs).

The axes: cgroup v1 and v2; BFQ, blk-iocost or neither; the pids and cpuset controllers
there or not; the data dir on a loop-mounted image, on an NVMe partition, on a
device-mapper volume, on tmpfs; Pal in a systemd service with Delegate=yes and in a login
shell. Then the other host probes: accelerator, reflink, /run/netns, nftables, tun, user
namespaces, unprivileged userfaultfd, seccomp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pal.config import Settings
from pal.errors import Unavailable
from pal.manager import hostcaps
from pal.manager.hostcaps import Capability, HostView
from pal.vmm import accel, cgroups
from pal.vmm.cgroups import DISK_KERNEL, IO_WEIGHT, Limits
from pal.vmm.disk_limits import DiskLimits
from tests.hostfakes import V1_ALL, V1_KNOBS, V2_KNOBS, FakeCgroupFs, FakeSys, v1_tree, v2_tree

NO_BFQ = "[none] mq-deadline kyber"  # this project's CI machines, most cloud kernels
BFQ = "mq-deadline kyber [bfq] none"
BFQ_OFFERED = "[mq-deadline] kyber bfq none"  # BFQ in the kernel, not chosen for the disk


@dataclass
class Host:
    """A fake host: its cgroupfs, its block devices and where the data dir is."""

    version: str = "v1"
    device: str = "loop"  # loop | nvme | dm | tmpfs
    schedulers: str = NO_BFQ  # the bottom disk's
    bfq_knob: bool = False  # the kernel has BFQ (its weight knob exists)
    iocost: bool = False  # v2: blk-iocost enabled for the bottom disk
    controllers: tuple[str, ...] = ()  # () = all of the version's usual ones
    throttle: bool = True  # the kernel has blk-throttle
    shared_cgroup: bool = False  # v2: a login shell's scope (other processes beside Pal)
    extra: dict[str, object] = field(default_factory=dict)

    def build(self, tmp: Path) -> tuple[HostView, Settings]:
        data = tmp / "data"
        data.mkdir(parents=True)
        sys_ = self._block(tmp, str(data))
        fs = self._cgroups(tmp, sys_)
        view = HostView(
            cgroup_root=fs.root,
            proc_self_cgroup=fs.proc,
            cgroup_fs=fs,
            block=sys_.block_host(),
            proc_sys=_sysctls(tmp, {"user/max_user_namespaces": "0", "vm/unprivileged_userfaultfd": "0"}),
            dev=_devs(tmp, ["net/tun"]),
            netns_dir=tmp / "run" / "netns",
            mountinfo=tmp / "mountinfo",
            qemu_version=lambda: "7.2.22",
            qemu_sandbox=lambda: True,
            nft_available=lambda: None,
            reflink=lambda _p: True,
            probe_accel=lambda _s: accel.AccelInfo("tcg", "/dev/kvm is absent; using TCG"),
            writable=lambda _p: True,
        )
        (tmp / "mountinfo").write_text("")
        return view, Settings(data_dir=data)

    def _block(self, tmp: Path, data: str) -> FakeSys:
        sys_ = FakeSys(tmp / "sys")
        if self.device == "loop":  # the data dir's XFS image (on a host whose / cannot reflink)
            sys_.disk("vda", "254:0", self.schedulers)
            sys_.disk("loop0", "7:0", NO_BFQ, loop="/var/lib/pal.xfs.img")
            sys_.mounts = {data: "7:0", "/var/lib/pal.xfs.img": "254:0"}
        elif self.device == "nvme":
            disk = sys_.disk("nvme0n1", "259:0", self.schedulers)
            sys_.partition(disk, "nvme0n1p2", "259:2")
            sys_.mounts = {data: "259:2"}
        elif self.device == "dm":  # LVM on an NVMe partition
            disk = sys_.disk("nvme0n1", "259:0", self.schedulers)
            part = sys_.partition(disk, "nvme0n1p3", "259:3")
            sys_.disk("dm-0", "253:0", "none", slaves=(part,))
            sys_.mounts = {data: "253:0"}
        else:  # tmpfs: no block device
            sys_.mounts = {data: "0:45"}
        return sys_

    def _cgroups(self, tmp: Path, sys_: FakeSys) -> FakeCgroupFs:
        if self.version == "v1":
            knobs = {k: list(v) for k, v in V1_KNOBS.items()}
            knobs["blkio"] = [k for k in knobs["blkio"] if (self.bfq_knob or "weight" not in k)]
            knobs["blkio"] = [k for k in knobs["blkio"] if (self.throttle or "throttle" not in k)]
            return v1_tree(tmp, self.controllers or V1_ALL, knobs, **self.extra)  # type: ignore[arg-type]
        v2 = {k: list(v) for k, v in V2_KNOBS.items()}
        v2["io"] = ["io.max"] if self.throttle else []
        if self.iocost:
            v2["io"].append("io.weight")
        if self.bfq_knob:
            v2["io"].append("io.bfq.weight")
        procs = [os.getpid(), 1] if self.shared_cgroup else [os.getpid()]
        available = " ".join(self.controllers or ("cpu", "io", "memory", "pids"))
        bottom = {"loop": "254:0", "nvme": "259:0", "dm": "259:0"}.get(self.device, "")
        qos = f"{bottom} enable=1 ctrl=auto\n" if self.iocost else ""
        return v2_tree(tmp, procs, available, v2, cost_qos=qos)


def _sysctls(tmp: Path, values: dict[str, str]) -> Path:
    root = tmp / "proc-sys"
    for name, value in values.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(value + "\n")
    return root


def _devs(tmp: Path, present: list[str]) -> Path:
    root = tmp / "dev"
    for name in present:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def caps(host: Host, tmp: Path, **settings: object) -> dict[str, Capability]:
    view, s = host.build(tmp)
    for k, v in settings.items():
        setattr(s, k, v)
    return {c.name: c for c in hostcaps.report(s, view)}


def vm_cgroup(host: Host, tmp: Path, disk: DiskLimits = DiskLimits(100, 50, 1000)) -> cgroups.VmCgroup:
    view, s = host.build(tmp)
    h = view.discover_cgroups()
    return h.create("s-1", Limits.for_vm(1, 256, disk), s.data_dir / "vms" / "s-1")


def stops_vms(found: dict[str, Capability]) -> set[str]:
    """What makes `pal doctor` exit non-zero."""
    return {name for name, c in found.items() if c.ok is False}


# -- the IO weight and the kernel's disk throttle, host by host ------------------------------

# (host, the weight's knob written or the reason it is skipped, the throttle's device)
MATRIX = {
    "v1-loop-no-bfq (this CI machine)": (Host("v1", "loop"), "no IO weight knob", "7:0"),
    "v1-loop-bfq (lost below a loop)": (
        Host("v1", "loop", BFQ, bfq_knob=True),
        "loop worker",
        "7:0",
    ),
    "v1-nvme-bfq": (Host("v1", "nvme", BFQ, bfq_knob=True), "blkio.bfq.weight=100", "259:0"),
    "v1-nvme-bfq-not-chosen": (Host("v1", "nvme", BFQ_OFFERED, bfq_knob=True), "ignores weights", "259:0"),
    "v1-dm-over-bfq": (Host("v1", "dm", BFQ, bfq_knob=True), "blkio.bfq.weight=100", "253:0"),
    "v1-nvme-no-bfq": (Host("v1", "nvme"), "no IO weight knob", "259:0"),
    "v2-loop-iocost": (Host("v2", "loop", iocost=True), "io.weight=default 100", "7:0"),
    "v2-nvme-bfq-not-chosen": (Host("v2", "nvme", bfq_knob=True), "ignores weights", "259:0"),
    "v2-nvme-bfq": (Host("v2", "nvme", BFQ, bfq_knob=True), "io.bfq.weight=default 100", "259:0"),
    "v2-dm-iocost": (Host("v2", "dm", iocost=True), "io.weight=default 100", "253:0"),
    "v2-nvme-neither": (Host("v2", "nvme"), "no IO weight knob", "259:0"),
}


@pytest.mark.parametrize(("host", "weight", "throttled"), MATRIX.values(), ids=MATRIX.keys())
def test_io_weight_where_it_works_and_the_throttle_on_the_device_qemu_writes_to(
    host: Host, weight: str, throttled: str, tmp_path: Path
) -> None:
    cg = vm_cgroup(host, tmp_path)
    assert {"cpu", "memory", "pids"} <= set(cg.applied), "the protecting limits always hold"
    if IO_WEIGHT in cg.applied:
        assert weight in cg.applied[IO_WEIGHT]
    else:
        assert weight in cg.skipped[IO_WEIGHT]
    assert cg.applied[DISK_KERNEL].startswith("read 100 MiB/s, write 50 MiB/s, 1000 IOPS on ")
    assert f"({throttled}, " in cg.applied[DISK_KERNEL]
    io = cg.dirs["unified"] if host.version == "v2" else cg.dirs["blkio"]
    knob = "io.max" if host.version == "v2" else "blkio.throttle.write_bps_device"
    assert (io / knob).read_text().startswith(throttled + " ")
    found = caps(host, tmp_path / "doctor")
    assert stops_vms(found) == set(), "an IO weight or throttle never stops VMs"
    line = found["io weight"]
    assert (line.state == "used") == (IO_WEIGHT in cg.applied)
    if line.state == "missing":
        assert line.effect and line.fix, "a missing capability says what it costs and how to get it"
    assert found["disk throttle (kernel)"].state == "used"
    assert found["disk throttle (QEMU)"].state == "used"


def test_this_ci_machine_names_the_missing_io_weight_and_uses_the_throttle(tmp_path: Path) -> None:
    """Debian 12 on kernel 6.18, cgroup v1, no BFQ, the data dir a loop-mounted XFS image."""
    found = caps(Host("v1", "loop", "none [mq-deadline] kyber"), tmp_path)
    weight = found["io weight"].line()
    assert weight.startswith("MISSING: no IO weight knob (blkio.bfq.weight or blkio.weight)")
    assert "modprobe bfq" in weight and "the disk throttle still bounds each VM" in weight
    kernel = found["disk throttle (kernel)"].line()
    assert "on loop0 (7:0, blkio.throttle)" in kernel and "writeback" in kernel
    device = found["data dir device"].detail
    assert device.endswith("/data on loop0 (7:0, loop: /var/lib/pal.xfs.img on vda, mq-deadline)")


def test_the_weight_follows_the_vms_size(tmp_path: Path) -> None:
    host = Host("v2", "nvme", BFQ, bfq_knob=True)
    view, s = host.build(tmp_path)
    h = view.discover_cgroups()
    big = h.create("s-4", Limits.for_vm(4, 256), s.data_dir / "vms" / "s-4")
    assert big.applied[IO_WEIGHT].startswith("io.bfq.weight=default 400"), "100 per vCPU"
    huge = h.create("s-16", Limits.for_vm(16, 256), s.data_dir / "vms" / "s-16")
    assert huge.applied[IO_WEIGHT].startswith("io.bfq.weight=default 1000"), "bfq's range ends at 1000"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_no_io_controller_skips_weight_and_throttle_and_vms_still_start(version: str, tmp_path: Path) -> None:
    ctrls = ("cpu", "cpuacct", "memory", "pids") if version == "v1" else ("cpu", "memory", "pids")
    host = Host(version, "nvme", BFQ, bfq_knob=True, controllers=ctrls)
    cg = vm_cgroup(host, tmp_path)
    assert set(cg.skipped) == {IO_WEIGHT, DISK_KERNEL}
    assert all(("not mounted" if version == "v1" else "not delegated") in why for why in cg.skipped.values())
    found = caps(host, tmp_path / "doctor")
    assert stops_vms(found) == set()
    assert found["disk throttle (kernel)"].state == "missing"
    assert "QEMU's own throttle still bounds every guest" in found["disk throttle (kernel)"].effect


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_kernel_without_blk_throttle(version: str, tmp_path: Path) -> None:
    cg = vm_cgroup(Host(version, "nvme", throttle=False), tmp_path)
    assert "CONFIG_BLK_DEV_THROTTLING" in cg.skipped[DISK_KERNEL]


def test_a_data_dir_without_a_block_device(tmp_path: Path) -> None:
    cg = vm_cgroup(Host("v2", "tmpfs", iocost=True), tmp_path)
    assert "without a block device" in cg.skipped[DISK_KERNEL]
    found = caps(Host("v2", "tmpfs", iocost=True), tmp_path / "doctor")
    assert found["data dir device"].state == "missing" and stops_vms(found) == set()


# -- the required controllers, and where Pal runs --------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_without_the_pids_controller_no_vm_starts_and_doctor_says_why(version: str, tmp_path: Path) -> None:
    ctrls = ("cpu", "cpuacct", "memory", "blkio") if version == "v1" else ("cpu", "io", "memory")
    host = Host(version, "nvme", controllers=ctrls)
    view, _ = host.build(tmp_path)
    with pytest.raises(Unavailable, match="pids"):
        view.discover_cgroups()
    found = caps(host, tmp_path / "doctor")
    assert stops_vms(found) == {"cgroups", "pids limit"}
    assert found["cpu limit"].state == found["memory limit"].state == "used"
    fix = found["pids limit"].fix
    assert ("mount -t cgroup -o pids" in fix) if version == "v1" else ("Delegate=yes" in fix)
    opt_out = found["cgroups"].fix
    assert "PAL_CGROUPS=off" in opt_out and "runaway" in opt_out, "turning it off says what is lost"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cpuset_controller_changes_nothing(version: str, tmp_path: Path) -> None:
    with_cpuset = (*V1_ALL, "cpuset") if version == "v1" else ("cpu", "cpuset", "io", "memory", "pids")
    cg = vm_cgroup(Host(version, "nvme", controllers=with_cpuset), tmp_path)
    if version == "v1":
        assert set(cg.dirs) == {"cpu", "cpuacct", "memory", "pids", "blkio"}, "vCPUs are not pinned"
    else:
        enabled = (cg.dirs["unified"].parent / "cgroup.subtree_control").read_text().split()
        assert sorted(enabled) == ["cpu", "io", "memory", "pids"], "vCPUs are not pinned"
    found = caps(Host(version, "nvme", controllers=with_cpuset), tmp_path / "doctor")
    assert found["cpuset"].state == "not needed" and stops_vms(found) == set()


def test_v2_in_a_service_with_delegate_yes(tmp_path: Path) -> None:
    host = Host("v2", "nvme", iocost=True)
    view, _ = host.build(tmp_path)
    h = view.discover_cgroups()
    svc = view.cgroup_root / "system.slice" / "pal.service"
    assert (svc / cgroups.MANAGER_LEAF / "cgroup.procs").read_text().split() == [str(os.getpid())]
    assert h.parents == {"unified": svc / "pal"}
    assert stops_vms(caps(host, tmp_path / "doctor")) == set()


def test_v2_in_a_login_shell_stops_vms_with_the_way_out(tmp_path: Path) -> None:
    found = caps(Host("v2", "nvme", shared_cgroup=True), tmp_path)
    assert stops_vms(found) == {"cgroups"}
    assert "systemd-run --scope -p Delegate=yes pal up" in found["cgroups"].detail


@pytest.mark.parametrize(
    "where",
    [{"own": "/system.slice/pal.service"}, {"own": "/user.slice/user-0.slice/session-3.scope"}],
    ids=["v1-service", "v1-login-shell"],
)
def test_v1_nests_under_pals_cgroup_wherever_it_runs(where: dict[str, str], tmp_path: Path) -> None:
    host = Host("v1", "nvme", extra=dict(where))
    cg = vm_cgroup(host, tmp_path)
    assert all(where["own"] in str(d) for d in cg.dirs.values())
    assert stops_vms(caps(host, tmp_path / "doctor")) == set()


def test_v1_with_cpu_and_cpuacct_mounted_together(tmp_path: Path) -> None:
    cg = vm_cgroup(Host("v1", "nvme", extra={"comount": True}), tmp_path)
    assert cg.applied["cpu"] == "cpu.cfs_quota_us=150000"


def test_cgroups_turned_off_say_what_is_lost(tmp_path: Path) -> None:
    found = caps(Host("v1", "loop"), tmp_path, cgroups=False)
    assert {found[n].state for n in ("cgroups", "cpu limit", "memory limit", "pids limit")} == {"off"}
    assert "runaway" in found["cgroups"].effect and stops_vms(found) == set()


def test_disk_limits_turned_off_say_what_is_lost(tmp_path: Path) -> None:
    found = caps(Host("v1", "loop"), tmp_path, disk_read_mibps=None, disk_write_mibps=None, disk_iops=None)
    assert found["disk throttle (QEMU)"].state == "off"
    assert "takes the disk from the others" in found["disk throttle (QEMU)"].effect


# -- the other host probes -------------------------------------------------------------------


def test_accelerator_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host("v1", "loop")
    view, s = host.build(tmp_path)
    view.probe_accel = accel.probe
    monkeypatch.setattr(accel, "KVM_DEVICE", tmp_path / "no-kvm")
    line = {c.name: c for c in hostcaps.report(s, view)}["accelerator"]
    assert line.detail.startswith("tcg (") and "absent" in line.detail and "working /dev/kvm" in line.fix
    assert line.ok is True, "TCG is slower, never a failure"
    kvm = view.dev / "kvm"  # the device, open to its group (as Debian's udev rule makes it)
    kvm.write_text("")
    os.chown(kvm, 0, 1000)
    kvm.chmod(0o660)
    monkeypatch.setattr(accel, "KVM_DEVICE", kvm)
    (s.images_dir / "default").mkdir(parents=True)
    (s.images_dir / "default" / "vmlinux").write_text("")
    monkeypatch.setattr(accel, "boot_probe", lambda *_a: "KVM internal error while booting the probe VM")
    line = {c.name: c for c in hostcaps.report(s, view)}["accelerator"]
    assert "KVM internal error" in line.detail and line.ok is True
    (s.images_dir / "accel.json").unlink()
    monkeypatch.setattr(accel, "boot_probe", lambda *_a: None)
    line = {c.name: c for c in hostcaps.report(s, view)}["accelerator"]
    assert line.detail.startswith("kvm (") and not line.effect
    s.accel = "tcg"
    line = {c.name: c for c in hostcaps.report(s, view)}["accelerator"]
    assert "forced" in line.detail and not line.effect


def test_reflink_missing_costs_speed_only(tmp_path: Path) -> None:
    view, s = Host().build(tmp_path)
    view.reflink = lambda _p: False
    line = {c.name: c for c in hostcaps.report(s, view)}["reflink"]
    assert line.state == "missing" and line.ok is None and "qcow2" in line.effect and "XFS" in line.fix


@pytest.mark.parametrize(
    ("setup", "state", "stops"),
    [
        ("mounted", "used", False),  # as after the first VM
        ("absent", "used", False),  # a fresh boot: Pal makes it at the first VM
        ("read-only", "missing", True),
    ],
)
def test_run_netns(setup: str, state: str, stops: bool, tmp_path: Path) -> None:
    view, s = Host().build(tmp_path)
    if setup == "mounted":
        view.netns_dir.mkdir(parents=True)
        view.mountinfo.write_text(f"612 27 0:26 /netns {view.netns_dir} rw shared:5 - tmpfs tmpfs rw\n")
    if setup == "read-only":
        view.writable = lambda _p: False
    line = {c.name: c for c in hostcaps.report(s, view)}["/run/netns"]
    assert (line.state, line.stops_vms) == (state, stops)


def test_tun_and_nftables_missing_stop_vms(tmp_path: Path) -> None:
    view, s = Host().build(tmp_path)
    view.dev = _devs(tmp_path / "bare", [])

    def no_nft() -> None:
        raise Unavailable("libnftables.so.1 not found")

    view.nft_available = no_nft
    found = {c.name: c for c in hostcaps.report(s, view)}
    assert stops_vms(found) == {"tun", "nftables"}
    assert found["tun"].fix == "`modprobe tun`" and "libnftables1" in found["nftables"].fix


@pytest.mark.parametrize("values", [{"a": "0"}, {"a": "15000"}, {}], ids=["off", "on", "absent"])
def test_user_namespaces_and_userfaultfd_are_not_needed(values: dict[str, str], tmp_path: Path) -> None:
    view, s = Host().build(tmp_path)
    names = ("user/max_user_namespaces", "vm/unprivileged_userfaultfd")
    sysctls = {name: values["a"] for name in names} if values else {}
    view.proc_sys = _sysctls(tmp_path / "other", sysctls) if values else tmp_path / "no-proc"
    found = {c.name: c for c in hostcaps.report(s, view)}
    shown = values.get("a", "absent")
    assert found["user namespaces"].detail.startswith(f"user.max_user_namespaces={shown}:")
    assert found["userfaultfd"].detail.startswith(f"vm.unprivileged_userfaultfd={shown}:")
    assert found["user namespaces"].ok is None and found["userfaultfd"].ok is None


def test_seccomp(tmp_path: Path) -> None:
    view, s = Host().build(tmp_path)
    view.qemu_sandbox = lambda: False
    line = {c.name: c for c in hostcaps.report(s, view)}["seccomp"]
    assert line.stops_vms and "PAL_SECCOMP=off (QEMU then runs without its syscall filter" in line.fix
    assert "whole kernel API" in line.fix, "turning it off says what is lost"
    s.seccomp = False
    line = {c.name: c for c in hostcaps.report(s, view)}["seccomp"]
    assert line.state == "off" and not line.stops_vms and "whole kernel API" in line.effect


def test_jail(tmp_path: Path) -> None:
    view, s = Host().build(tmp_path)
    view.euid = lambda: 0
    assert {c.name: c for c in hostcaps.report(s, view)}["jail"].state == "used"
    view.euid = lambda: 1000
    line = {c.name: c for c in hostcaps.report(s, view)}["jail"]
    assert line.state == "missing" and "uid 1000" in line.detail and "root" in line.fix and not line.stops_vms


def test_a_kvm_device_only_root_can_open_stops_vms(tmp_path: Path) -> None:
    """The jail runs each QEMU as its own uid: a /dev/kvm of mode 0600 (as on these hosts)
    works for the accelerator probe, which runs as root, and for no VM."""
    view, s = Host().build(tmp_path)
    view.euid = lambda: 0
    view.probe_accel = lambda _s: accel.AccelInfo("kvm", "a probe VM booted under KVM")
    kvm = view.dev / "kvm"
    kvm.write_text("")
    kvm.chmod(0o600)
    line = {c.name: c for c in hostcaps.report(s, view)}["accelerator"]
    assert line.stops_vms and "chmod 0660" in line.fix and "PAL_ACCEL=tcg" in line.fix
    os.chown(kvm, 0, 1000)
    kvm.chmod(0o660)
    assert {c.name: c for c in hostcaps.report(s, view)}["accelerator"].state == "used"
