"""Per-VM host limits (CPU, memory, pids, IO weight, disk throttle) on cgroup v1 and v2,
against the fake cgroupfs and sysfs of tests/hostfakes.py. The hosts users have, and what
`pal doctor` says on each, are tests/unit/test_host_matrix.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pal.errors import Unavailable
from pal.vmm.cgroups import DISK_KERNEL, IO_WEIGHT, MANAGER_LEAF, Limits
from pal.vmm.disk_limits import DiskLimits
from tests.hostfakes import FakeSys, discover, v1_tree, v2_tree


def nvme_bfq(tmp_path: Path) -> FakeSys:
    """The data dir (/data) on nvme0n1p1, the disk's scheduler BFQ."""
    sys = FakeSys(tmp_path / "sys", {"/data": "259:1"})
    disk = sys.disk("nvme0n1", "259:0", "mq-deadline kyber [bfq] none")
    sys.partition(disk, "nvme0n1p1", "259:1")
    return sys


def test_limits_for_a_vm() -> None:
    lim = Limits.for_vm(vcpus=2, memory_mib=256)
    assert lim.cpu_quota_us == 250_000, "vCPUs + half a core for QEMU's own threads"
    assert lim.memory_bytes == (256 + 384) << 20, "guest RAM + QEMU overhead"
    assert lim.pids == 256 and lim.io_weight == 200, "100 per vCPU, as the CPU quota"
    assert not lim.disk, "no disk bound unless asked"


def test_v1_every_limit_written_under_pals_own_cgroup_and_removed_after(tmp_path: Path) -> None:
    fs = v1_tree(tmp_path)
    host = discover(fs, nvme_bfq(tmp_path).block_host())
    assert host.version == "v1"
    assert host.parents["memory"] == fs.root / "memory" / "svc" / "pal", "nested under Pal's own cgroup"
    cg = host.create("vm1", Limits.for_vm(1, 256, DiskLimits(50, 20, 300)), Path("/data/vms/s-1"))
    d = cg.dirs
    assert (d["cpu"] / "cpu.cfs_quota_us").read_text() == "150000"
    assert (d["cpu"] / "cpu.cfs_period_us").read_text() == "100000"
    assert (d["memory"] / "memory.limit_in_bytes").read_text() == str(640 << 20)
    assert (d["pids"] / "pids.max").read_text() == "256"
    assert (d["blkio"] / "blkio.bfq.weight").read_text() == "100"
    # the throttle on the whole disk the partition is on (cgroups take no partitions)
    assert (d["blkio"] / "blkio.throttle.read_bps_device").read_text() == f"259:0 {50 << 20}"
    assert (d["blkio"] / "blkio.throttle.write_bps_device").read_text() == f"259:0 {20 << 20}"
    assert (d["blkio"] / "blkio.throttle.write_iops_device").read_text() == "259:0 300"
    assert set(cg.applied) == {"cpu period", "cpu", "memory", "pids", IO_WEIGHT, DISK_KERNEL}
    assert cg.skipped == {}
    cg.add(4242)
    assert all((x / "cgroup.procs").read_text().split() == ["4242"] for x in d.values())
    assert host.existing("vm1") is not None and host.existing("other") is None
    for x in d.values():  # the kernel empties a cgroup when its last process exits
        (x / "cgroup.procs").write_text("")
    cg.remove()
    assert not any(x.exists() for x in d.values())


def test_new_disk_limits_replace_the_old_ones(tmp_path: Path) -> None:
    """A claimed pooled VM takes its tenant's bounds: what it no longer asks is cleared."""
    host = discover(v1_tree(tmp_path), nvme_bfq(tmp_path).block_host())
    cg = host.create("vm1", Limits.for_vm(1, 256, DiskLimits(50, 20, 300)), Path("/data/vms/s-1"))
    host.limit_disk(cg, DiskLimits(write_mibps=5), Path("/data/vms/s-1"))
    blkio = cg.dirs["blkio"]
    assert (blkio / "blkio.throttle.read_bps_device").read_text() == "259:0 0", "0: no bound"
    assert (blkio / "blkio.throttle.write_bps_device").read_text() == f"259:0 {5 << 20}"
    assert (blkio / "blkio.throttle.read_iops_device").read_text() == "259:0 0"
    assert cg.applied[DISK_KERNEL].startswith("write 5 MiB/s on nvme0n1")


def test_v1_missing_controller_fails_closed_and_names_the_opt_out(tmp_path: Path) -> None:
    fs = v1_tree(tmp_path, controllers=("cpu", "memory", "blkio"))
    with pytest.raises(Unavailable, match=r"pids.*PAL_CGROUPS=off"):
        discover(fs)


def test_v1_no_io_weight_knob_still_applies_the_protecting_limits(tmp_path: Path) -> None:
    fs = v1_tree(tmp_path)
    fs.knobs = {**fs.knobs, "blkio": []}  # a kernel without BFQ, nor blk-throttle
    host = discover(fs, nvme_bfq(tmp_path).block_host())
    cg = host.create("vm1", Limits.for_vm(1, 256, DiskLimits(50)), Path("/data/vms/s-1"))
    assert set(cg.applied) == {"cpu period", "cpu", "memory", "pids"}
    assert "no IO weight knob" in cg.skipped[IO_WEIGHT]
    assert "CONFIG_BLK_DEV_THROTTLING" in cg.skipped[DISK_KERNEL]


def test_v2_pal_alone_in_its_cgroup_steps_into_a_leaf_and_delegates(tmp_path: Path) -> None:
    fs = v2_tree(tmp_path, own_procs=[os.getpid()], cost_qos="259:0 enable=1 ctrl=auto\n")
    host = discover(fs, nvme_bfq(tmp_path).block_host())
    svc = fs.root / "system.slice" / "pal.service"
    assert host.version == "v2" and host.parents == {"unified": svc / "pal"}
    assert (svc / MANAGER_LEAF / "cgroup.procs").read_text().split() == [str(os.getpid())]
    assert (svc / "cgroup.procs").read_text().split() == []
    assert set((svc / "cgroup.subtree_control").read_text().split()) == {"cpu", "io", "memory", "pids"}
    assert set((svc / "pal" / "cgroup.subtree_control").read_text().split()) == {
        "cpu",
        "io",
        "memory",
        "pids",
    }
    cg = host.create("vm1", Limits.for_vm(2, 512, DiskLimits(iops=900)), Path("/data/vms/s-1"))
    u = cg.dirs["unified"]
    assert (u / "cpu.max").read_text() == "250000 100000"
    assert (u / "memory.max").read_text() == str((512 + 384) << 20)
    assert (u / "pids.max").read_text() == "256"
    assert (u / "io.weight").read_text() == "default 200", "blk-iocost is on for the disk"
    assert (u / "io.max").read_text() == "259:0 rbps=max wbps=max riops=900 wiops=900"
    (u / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\n")
    assert cg.cpu_usage_ns() == 1_500_000


def test_v2_cgroup_shared_with_other_processes_is_refused_with_a_way_out(tmp_path: Path) -> None:
    fs = v2_tree(tmp_path, own_procs=[os.getpid(), 1])  # e.g. a login shell's scope
    with pytest.raises(Unavailable, match="Delegate=yes"):
        discover(fs)
    svc = fs.root / "system.slice" / "pal.service"
    assert not (svc / MANAGER_LEAF).exists(), "Pal did not move itself for nothing"


def test_v2_missing_controller_fails_closed(tmp_path: Path) -> None:
    fs = v2_tree(tmp_path, own_procs=[os.getpid()], available="cpu io memory")
    with pytest.raises(Unavailable, match="pids"):
        discover(fs)


def test_a_leftover_vms_cgroups_are_removed_even_in_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QEMU a restarted manager killed (it had no state.json to adopt it by) leaves its
    cgroups; whatever is left of them goes, other VMs' stay."""
    from pal.vmm import cgroups

    fs = v1_tree(tmp_path)
    host = discover(fs)
    monkeypatch.setattr(cgroups, "_host", host)
    left = host.create("vm-left", Limits.for_vm(1, 256))
    keep = host.create("vm-keep", Limits.for_vm(1, 256))
    assert left.skipped == {}, "nothing asked of the disk, no data dir: nothing to skip"
    fs.rmdir(left.dirs["cpu"])  # a removal cut short by the crash
    assert cgroups.remove_leftover("vm-left") is True
    assert not any(d.exists() for d in left.dirs.values())
    assert all(d.exists() for d in keep.dirs.values())
    assert cgroups.remove_leftover("vm-left") is False
