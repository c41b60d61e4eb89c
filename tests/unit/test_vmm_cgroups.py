"""Per-VM host limits (CPU, memory, pids, IO weight) on cgroup v1 and v2, against a fake
cgroupfs tree that behaves like the kernel where it matters: interface files appear on
mkdir for the controllers a level has, a knob that does not exist cannot be written, and
a v2 cgroup with processes cannot enable controllers for its children (EBUSY)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from pal.errors import Unavailable
from pal.vmm.cgroups import MANAGER_LEAF, CgroupFs, CgroupHost, Limits

V1_KNOBS = {
    "cpu": ["cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares"],
    "cpuacct": ["cpuacct.usage"],
    "memory": ["memory.limit_in_bytes"],
    "pids": ["pids.max"],
    "blkio": ["blkio.bfq.weight"],
}
V2_KNOBS = {
    "cpu": ["cpu.max", "cpu.stat"],
    "memory": ["memory.max"],
    "pids": ["pids.max"],
    "io": ["io.weight"],
}


class FakeCgroupFs(CgroupFs):
    def __init__(self, root: Path, v2: bool, knobs: dict[str, list[str]]) -> None:
        self.root, self.v2, self.knobs = root, v2, knobs

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
            if d != self.cgroup_root() and (d / "cgroup.procs").read_text().split():
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

    def cgroup_root(self) -> Path:
        return self.root


def v1_tree(
    tmp_path: Path, controllers: tuple[str, ...] = ("cpu", "cpuacct", "memory", "pids", "blkio")
) -> FakeCgroupFs:
    fs = FakeCgroupFs(tmp_path / "cg", False, V1_KNOBS)
    proc = tmp_path / "proc-self-cgroup"
    lines = []
    for i, c in enumerate(controllers):
        own = "/svc" if c == "memory" else "/"
        (fs.root / c / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if c == "cpuacct":
            (fs.root / c / "cpuacct.usage").write_text("0")
        lines.append(f"{i + 1}:{c}:{own}")
    proc.write_text("\n".join([*lines, "0::/"]) + "\n")
    fs.proc = proc  # type: ignore[attr-defined]
    return fs


def v2_tree(tmp_path: Path, own_procs: list[int], available: str = "cpu io memory pids") -> FakeCgroupFs:
    fs = FakeCgroupFs(tmp_path / "cg", True, V2_KNOBS)
    root = fs.root
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(available)
    (root / "cgroup.subtree_control").write_text(available)
    (root / "cgroup.procs").write_text("")
    fs.mkdir(root / "system.slice")
    fs.write(root / "system.slice" / "cgroup.subtree_control", "+" + " +".join(available.split()))
    svc = root / "system.slice" / "pal.service"
    fs.mkdir(svc)
    (svc / "cgroup.procs").write_text(" ".join(str(p) for p in own_procs))
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/system.slice/pal.service\n")
    fs.proc = proc  # type: ignore[attr-defined]
    return fs


def discover(fs: FakeCgroupFs) -> CgroupHost:
    return CgroupHost.discover(root=fs.root, proc_self=fs.proc, fs=fs)  # type: ignore[attr-defined]


def test_limits_for_a_vm() -> None:
    lim = Limits.for_vm(vcpus=2, memory_mib=256)
    assert lim.cpu_quota_us == 250_000, "vCPUs + half a core for QEMU's own threads"
    assert lim.memory_bytes == (256 + 384) << 20, "guest RAM + QEMU overhead"
    assert lim.pids == 256 and lim.io_weight == 100


def test_v1_every_limit_written_under_pals_own_cgroup_and_removed_after(tmp_path: Path) -> None:
    fs = v1_tree(tmp_path)
    host = discover(fs)
    assert host.version == "v1"
    assert host.parents["memory"] == fs.root / "memory" / "svc" / "pal", "nested under Pal's own cgroup"
    cg = host.create("vm1", Limits.for_vm(1, 256))
    d = cg.dirs
    assert (d["cpu"] / "cpu.cfs_quota_us").read_text() == "150000"
    assert (d["cpu"] / "cpu.cfs_period_us").read_text() == "100000"
    assert (d["memory"] / "memory.limit_in_bytes").read_text() == str(640 << 20)
    assert (d["pids"] / "pids.max").read_text() == "256"
    assert (d["blkio"] / "blkio.bfq.weight").read_text() == "100"
    assert set(cg.applied) == {"cpu period", "cpu", "memory", "pids", "io"}
    cg.add(4242)
    assert all((x / "cgroup.procs").read_text().split() == ["4242"] for x in d.values())
    assert host.existing("vm1") is not None and host.existing("other") is None
    for x in d.values():  # the kernel empties a cgroup when its last process exits
        (x / "cgroup.procs").write_text("")
    cg.remove()
    assert not any(x.exists() for x in d.values())


def test_v1_missing_controller_fails_closed_and_names_the_opt_out(tmp_path: Path) -> None:
    fs = v1_tree(tmp_path, controllers=("cpu", "memory", "blkio"))
    with pytest.raises(Unavailable, match=r"pids.*PAL_CGROUPS=off"):
        discover(fs)


def test_v1_no_io_weight_knob_still_applies_the_protecting_limits(tmp_path: Path) -> None:
    fs = v1_tree(tmp_path)
    fs.knobs = {**V1_KNOBS, "blkio": []}  # a kernel without a weight-aware scheduler
    host = discover(fs)
    cg = host.create("vm1", Limits.for_vm(1, 256))
    assert set(cg.applied) == {"cpu period", "cpu", "memory", "pids"}


def test_v2_pal_alone_in_its_cgroup_steps_into_a_leaf_and_delegates(tmp_path: Path) -> None:
    fs = v2_tree(tmp_path, own_procs=[os.getpid()])
    host = discover(fs)
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
    cg = host.create("vm1", Limits.for_vm(2, 512))
    u = cg.dirs["unified"]
    assert (u / "cpu.max").read_text() == "250000 100000"
    assert (u / "memory.max").read_text() == str((512 + 384) << 20)
    assert (u / "pids.max").read_text() == "256"
    assert (u / "io.weight").read_text() == "default 100"
    (u / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\n")
    assert cg.cpu_usage_ns() == 1_500_000


def test_v2_cgroup_shared_with_other_processes_is_refused_with_a_way_out(tmp_path: Path) -> None:
    fs = v2_tree(tmp_path, own_procs=[os.getpid(), 1])  # e.g. a login shell's scope
    with pytest.raises(Unavailable, match="Delegate=yes"):
        discover(fs)
    svc = fs.root / "system.slice" / "pal.service"
    assert not (svc / MANAGER_LEAF).exists(), "Pal did not move itself for nothing"


def test_v2_missing_controller_fails_closed(tmp_path: Path) -> None:
    fs = v2_tree(tmp_path, own_procs=[os.getpid()], available="cpu memory pids")
    with pytest.raises(Unavailable, match="io"):
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
    fs.rmdir(left.dirs["cpu"])  # a removal cut short by the crash
    assert cgroups.remove_leftover("vm-left") is True
    assert not any(d.exists() for d in left.dirs.values())
    assert all(d.exists() for d in keep.dirs.values())
    assert cgroups.remove_leftover("vm-left") is False
