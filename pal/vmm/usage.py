"""What one QEMU process costs the host right now: CPU time and memory (RSS and PSS).

Read from the kernel, never from the guest: ``/proc/<pid>/smaps_rollup`` for memory and the
VM's cgroup (or ``/proc/<pid>/stat``) for CPU. Each read is a few syscalls; the runtime
manager samples every live VM every few seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pal.vmm.cgroups import VmCgroup

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcessMemory:
    rss_bytes: int
    pss_bytes: int


def process_memory(pid: int) -> ProcessMemory | None:
    """RSS and PSS of ``pid`` from smaps_rollup (PSS splits pages shared with forks of one
    snapshot among them); None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss"):
            parts = rest.split()
            if parts:
                values[name] = int(parts[0]) * 1024  # kB
    if "Rss" not in values:
        return None
    return ProcessMemory(values["Rss"], values.get("Pss", values["Rss"]))


def process_cpu_ns(pid: int) -> int | None:
    """User + system CPU time of every thread of ``pid`` (clock-tick resolution)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields start after the last ")".
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (IndexError, ValueError):
        return None
    return ticks * 1_000_000_000 // _CLK_TCK


def cpu_ns(pid: int, cgroup: VmCgroup | None) -> tuple[int | None, str]:
    """Cumulative CPU time of a VM's QEMU and where it came from (``cgroup`` or ``proc``).

    The cgroup holds exactly the VM's QEMU, so both agree; the cgroup counter has
    nanosecond resolution and the /proc one is the fallback where cgroups are off.
    """
    if cgroup is not None:
        ns = cgroup.cpu_usage_ns()
        if ns is not None:
            return ns, "cgroup"
    return process_cpu_ns(pid), "proc"
