"""What the host asks of an idle guest: usage figures for metrics, and the idle probe."""

from __future__ import annotations

import os
import time
from typing import Any

TIMER_LIST = "/proc/timer_list"


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def guest_usage(disk_path: str) -> dict[str, int]:
    """Memory and disk use for the host's metrics: one small /proc read and one statvfs,
    cheap enough for every heartbeat. Missing figures are left out."""
    out: dict[str, int] = {}
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0]) * 1024
        if len(fields) == 2:
            out["mem_total"] = fields["MemTotal"]
            out["mem_used"] = fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, ValueError, IndexError):
        pass
    try:
        st = os.statvfs(disk_path)
        out["disk_total"] = st.f_blocks * st.f_frsize
        out["disk_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        pass
    return out


def probe(stat_path: str = "/proc/stat", timer_list: str = TIMER_LIST) -> dict[str, Any]:
    """Is the guest idle? What the host needs to decide a wait pause (protocol: probe).

    ``runnable``: tasks running or in uninterruptible sleep besides the prober itself;
    ``cpu_busy``/``cpu_total``: /proc/stat ticks (the host compares two probes);
    ``timer_ms``: the nearest deadline of a sleeping task (:func:`next_sleeper_ms`)."""
    out: dict[str, Any] = {"runnable": 0, "cpu_busy": 0, "cpu_total": 0, "timer_ms": None}
    running = blocked = 0
    try:
        with open(stat_path) as f:
            for line in f:
                if line.startswith("cpu "):
                    vals = [int(x) for x in line.split()[1:9]]
                    total = sum(vals)
                    out["cpu_total"], out["cpu_busy"] = total, total - vals[3] - vals[4]  # - idle, iowait
                elif line.startswith("procs_running "):
                    running = int(line.split()[1])
                elif line.startswith("procs_blocked "):
                    blocked = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    out["runnable"] = max(0, running - 1) + blocked
    try:
        with open(timer_list) as f:
            out["timer_ms"] = next_sleeper_ms(f.read())
    except OSError:
        pass
    return out


def next_sleeper_ms(timer_list: str) -> int | None:
    """Milliseconds until the nearest ``hrtimer_wakeup`` timer in /proc/timer_list: the
    deadline of a task sleeping with a timeout (nanosleep, poll/select/epoll, futex).
    Timer-wheel timeouts and the kernel's own hrtimers (tick, watchdog) are not those."""
    best: int | None = None
    want = False
    for line in timer_list.splitlines():
        if ", hrtimer_wakeup," in line:
            want = True
            continue
        if want and "[in " in line:
            want = False
            try:
                ns = int(line.split("[in ", 1)[1].split()[0])
            except (ValueError, IndexError):
                continue
            ms = max(0, ns // 1_000_000)
            best = ms if best is None else min(best, ms)
        elif line.lstrip().startswith("#") and ": <" in line:
            want = False
    return best


def uptime(fallback_start: float) -> float:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic() - fallback_start


# --------------------------------------------------------------------------- system (PID 1)
