"""Where the CPU of a benchmark phase went, by component (the leader, the followers,
PostgreSQL, the simulated nodes, the load generator), read from /proc: what each
operation costs the machine, next to its latency (docs/benchmarks/control-plane.md)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_secs(pid: int) -> float:
    """User + system CPU of ``pid`` so far (0 once it is gone)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    return 0.0


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a postmaster's backends)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


class CpuMeter:
    """``parts``: component name -> the pids it is now (asked at each reading)."""

    def __init__(self, parts: dict[str, Callable[[], list[int]]]) -> None:
        self.parts = parts

    def read(self) -> dict[str, float]:
        return {name: sum(cpu_secs(p) for p in pids()) for name, pids in self.parts.items()}

    @staticmethod
    def per_call(after: dict[str, float], before: dict[str, float], calls: int) -> dict[str, float]:
        """CPU ms per call of each component between two readings."""
        return {k: round((v - before.get(k, 0.0)) * 1000 / max(calls, 1), 2) for k, v in after.items()}
