"""The CPU this host has for new work: how many CPUs Pal may use (its cgroup's quota, v1 or
v2, or its affinity mask) and how many tasks are ready to run on them. Restores are
admitted by it (pal/manager/restore_gate.py), and a guest's first answer is timed by it.

The one rule for timeouts under load (``LoadSampler.cpu_now``, a clock of an uncontended
CPU): wall time counts divided by how many runnable tasks share each CPU (at least 1). A
guest that gets a quarter of a CPU has four times as long; load alone, or a long queue of
restores (each one runnable), never trips a timeout, while a guest that is stuck on an
idle host still does. The identify timeout (``Stretch``) and a silent harness (the node's
heartbeat reports its silence in this clock) both use it.
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pal.vmm.cgroups import PROC_SELF_CGROUP, ROOT, own_paths

LOADAVG = Path("/proc/loadavg")
SMOOTHING = 0.3  # weight of a new runnable sample: a burst of one sample moves it a third
SAMPLE_EVERY_S = 0.05  # at most one /proc read per this (many restores ask at once)
CLOCK_POINTS = 4096  # the CPU clock's history kept (one point per second at most: > 1 hour)


@dataclass(frozen=True)
class CpuLoad:
    capacity: float  # CPUs Pal may use
    others: float  # tasks ready to run host-wide besides ours (smoothed), the reader not counted
    own: int = 0  # our restores in flight (each one runnable)

    @property
    def sharing(self) -> float:
        """How many runnable tasks share each CPU (at least 1)."""
        return max(1.0, (self.others + self.own) / self.capacity)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def quota_cpus(root: Path = ROOT, proc_self: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPU quota of Pal's cgroup in CPUs (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); None when unlimited or unreadable."""
    text = _read(proc_self)
    if text is None:
        return None
    own = own_paths(text)
    if (root / "cgroup.controllers").exists():  # v2
        raw = _read(root / own.get("", "/").lstrip("/") / "cpu.max")
        parts = raw.split() if raw else []
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    for ctrl in ("cpu", "cpu,cpuacct"):
        if ctrl in own:
            d = root / ctrl / own[ctrl].lstrip("/")
            quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            if quota is not None and period is not None and quota.strip() != "-1":
                return _ratio(quota, period)
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def capacity(root: Path = ROOT, proc_self: Path = PROC_SELF_CGROUP) -> float:
    """CPUs Pal may use: its affinity mask, lowered by its cgroup's quota."""
    cpus = float(len(os.sched_getaffinity(0)))
    quota = quota_cpus(root, proc_self)
    return max(0.1, min(cpus, quota)) if quota is not None else cpus


def runnable_now(loadavg: Path = LOADAVG) -> int | None:
    """Tasks running or ready to run this instant (``/proc/loadavg``'s 4th field), less the
    reader itself."""
    text = _read(loadavg)
    try:
        return max(0, int(text.split()[3].split("/")[0]) - 1) if text else None
    except (IndexError, ValueError):
        return None


class LoadSampler:
    """``sample()``: the host's CPU load. The others' runnable count is smoothed over recent
    samples (one instant's count jumps with every wake-up); ours (``own``: the restores in
    flight) is exact, and taken out of each sample before smoothing, so a restore just
    admitted is not mistaken for someone else's load, nor missed."""

    def __init__(
        self,
        cpus: float | None = None,
        read: Callable[[], int | None] = runnable_now,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = cpus if cpus is not None else capacity()
        self._read, self.clock = read, clock
        self.own: Callable[[], int] = lambda: 0
        self._others: float | None = None
        self._at = -math.inf
        self._cpu = 0.0  # the CPU clock at ``_at``
        self._points: deque[tuple[float, float]] = deque(maxlen=CLOCK_POINTS)  # (wall, cpu)

    def sample(self) -> CpuLoad:
        now, own = self.clock(), self.own()
        if now - self._at >= SAMPLE_EVERY_S:
            if self._at > -math.inf:  # the interval since the last sample, at the load seen then
                self._cpu += (now - self._at) / self._load(own).sharing
            self._at = now
            if not self._points or now - self._points[-1][0] >= 1.0:
                self._points.append((now, self._cpu))
            got = self._read()
            if got is not None:
                seen, prev = max(0, got - own), self._others
                self._others = seen if prev is None else prev + SMOOTHING * (seen - prev)
        return self._load(own)

    def _load(self, own: int) -> CpuLoad:
        return CpuLoad(self.capacity, self._others or 0.0, own)

    def cpu_now(self) -> float:
        """Seconds of an uncontended CPU since this sampler started (the module's rule)."""
        self.sample()
        return self._cpu

    def cpu_since(self, then: float) -> float:
        """Seconds of an uncontended CPU since ``then`` (a time of this sampler's clock,
        ``time.monotonic`` by default); before the sampler's first point counts as wall time."""
        now_cpu = self.cpu_now()
        pts = self._points
        if not pts or then <= pts[0][0]:
            first = pts[0] if pts else (self._at, now_cpu)
            return max(0.0, first[0] - then) + (now_cpu - first[1])
        i = bisect.bisect_right(pts, then, key=lambda p: p[0]) - 1
        t0, c0 = pts[i]
        t1, c1 = pts[i + 1] if i + 1 < len(pts) else (self._at, self._cpu)
        at_then = c0 if t1 <= t0 else c0 + (c1 - c0) * (then - t0) / (t1 - t0)
        return max(0.0, now_cpu - at_then)


class Stretch:
    """A timeout of ``base_s`` seconds of an uncontended CPU (the module's rule)."""

    def __init__(self, base_s: float, sampler: LoadSampler) -> None:
        self.base_s, self.sampler = base_s, sampler
        self.started_cpu, self.started_wall = sampler.cpu_now(), sampler.clock()

    @property
    def expired(self) -> bool:
        return self.sampler.cpu_now() - self.started_cpu >= self.base_s

    def describe(self) -> str:
        wall = self.sampler.clock() - self.started_wall
        return f"{self.base_s:g}s of CPU time ({wall:.1f}s wall on a loaded host)"
