"""Host-side CPU and memory limits for one QEMU process, through cgroups (v1 or v2).

The guest already sees only its vCPUs and RAM; these limits protect the *host* from a
QEMU that misbehaves (TCG's translation cache, a runaway device thread). Each VM gets
``<Pal's own cgroup>/pal/<vm_id>`` under the cpu and memory controllers: nested below the
cgroup Pal itself runs in, so Pal never escapes limits its operator set on it.

Best effort: where the controllers are missing or not writable, VMs run without host
limits and `pal doctor` says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
# QEMU's own memory next to guest RAM: the TCG translation cache (64 MiB), device state,
# I/O buffers, the QMP and chardev threads. Generous: hitting it means QEMU is broken.
QEMU_OVERHEAD_MIB = 384
# vCPU threads get vcpus x 100 % of a core; half a core more for QEMU's main loop and I/O.
EXTRA_CPU_FRACTION = 0.5


def _own_path(controller: str) -> str | None:
    """This process's cgroup path for ``controller`` ("" for the v2 unified hierarchy)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(",") or (controller == "" and ctrls == ""):
            return path
    return None


def _v2() -> bool:
    return (ROOT / "cgroup.controllers").exists()


def _dirs(vm_id: str) -> dict[str, Path] | None:
    """Per-controller directories for ``vm_id`` (one directory on cgroup v2)."""
    if _v2():
        own = _own_path("")
        if own is None:
            return None
        return {"unified": ROOT / own.lstrip("/") / "pal" / vm_id}
    out = {}
    for ctrl in ("cpu", "memory"):
        own = _own_path(ctrl)
        mount = ROOT / ctrl
        if own is None or not mount.is_dir():
            return None
        out[ctrl] = mount / own.lstrip("/") / "pal" / vm_id
    return out


@dataclass
class VmCgroup:
    vm_id: str
    dirs: dict[str, Path]

    @classmethod
    def create(cls, vm_id: str, vcpus: int, memory_mib: int) -> VmCgroup | None:
        dirs = _dirs(vm_id)
        if dirs is None:
            return None
        quota = int((vcpus + EXTRA_CPU_FRACTION) * CFS_PERIOD_US)
        mem_bytes = (memory_mib + QEMU_OVERHEAD_MIB) * 1024 * 1024
        try:
            for d in dirs.values():
                d.mkdir(parents=True, exist_ok=True)
            if "unified" in dirs:
                d = dirs["unified"]
                (d / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
                (d / "memory.max").write_text(str(mem_bytes))
            else:
                (dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                (dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
                (dirs["memory"] / "memory.limit_in_bytes").write_text(str(mem_bytes))
        except OSError as exc:
            log.warning("no host cgroup limits for VM %s: %s", vm_id, exc)
            cg = cls(vm_id, dirs)
            cg.remove()
            return None
        return cls(vm_id, dirs)

    @classmethod
    def existing(cls, vm_id: str) -> VmCgroup | None:
        """The cgroup a previous manager made for an adopted VM, if any."""
        dirs = _dirs(vm_id)
        if dirs is None or not all(d.is_dir() for d in dirs.values()):
            return None
        return cls(vm_id, dirs)

    def add(self, pid: int) -> None:
        """Move the whole process (all its threads) into the VM's cgroups."""
        for d in self.dirs.values():
            try:
                (d / "cgroup.procs").write_text(str(pid))
            except OSError as exc:
                log.warning("could not put QEMU %d of %s into %s: %s", pid, self.vm_id, d, exc)

    def remove(self, timeout_s: float = 2.0) -> None:
        """Remove the (empty) cgroups; a just-killed process may take a moment to leave."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs.values():
            while d.exists():
                try:
                    os.rmdir(d)
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("cgroup %s still busy; left in place", d)
                        break
                    time.sleep(0.01)
            with contextlib.suppress(OSError):
                os.rmdir(d.parent)  # the "pal" parent, when this was the last VM


def describe() -> str:
    """What `pal doctor` shows."""
    dirs = _dirs("probe")
    if dirs is None:
        return "unavailable (no cpu/memory controller): VMs run without host limits"
    kind = "v2" if _v2() else "v1"
    return f"{kind} cpu + memory: per-VM CPU quota and memory limit"
