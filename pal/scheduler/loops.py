"""What each of the leader's loops costs per tick: wall time, the process's CPU meanwhile,
and the store statements and rows it ran (pal/store/counting.py). Shown to the operator in
``/healthz`` (``loops``) and ``/metrics`` (``pal_loop_*``), and read by `pal bench
control-plane` and tests/unit/test_loop_growth.py, which assert that no tick's reads grow
with the records it leaves alone (docs/scale.md).

CPU is the whole process's during the tick (asyncio interleaves other work with it: API
requests, node heartbeats), so it is an upper bound of the tick's own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pal.store.counting import counting


@dataclass
class LoopStats:
    ticks: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0
    last_seconds: float = 0.0
    cpu_seconds: float = 0.0
    statements: int = 0
    rows: int = 0
    last_statements: int = 0
    last_rows: int = 0
    max_rows: int = 0

    def view(self) -> dict[str, float | int]:
        return {
            "ticks": self.ticks,
            "secs": round(self.seconds, 4),
            "maxSecs": round(self.max_seconds, 4),
            "lastSecs": round(self.last_seconds, 4),
            "cpuSecs": round(self.cpu_seconds, 4),
            "statements": self.statements,
            "rows": self.rows,
            "lastStatements": self.last_statements,
            "lastRows": self.last_rows,
            "maxRows": self.max_rows,
        }


class LoopClock(Collector):
    def __init__(self) -> None:
        self.loops: dict[str, LoopStats] = {}

    @asynccontextmanager
    async def tick(self, name: str) -> AsyncIterator[None]:
        """One tick of the loop ``name``: timed and counted (also when it raises)."""
        st = self.loops.setdefault(name, LoopStats())
        wall, cpu = time.perf_counter(), time.process_time()
        with counting() as qc:
            try:
                yield
            finally:
                took = time.perf_counter() - wall
                st.ticks += 1
                st.seconds += took
                st.last_seconds = took
                st.max_seconds = max(st.max_seconds, took)
                st.cpu_seconds += time.process_time() - cpu
                st.statements += qc.statements
                st.rows += qc.rows
                st.last_statements, st.last_rows = qc.statements, qc.rows
                st.max_rows = max(st.max_rows, qc.rows)

    def report(self) -> dict[str, dict[str, float | int]]:
        return {name: st.view() for name, st in sorted(self.loops.items())}

    def collect(self) -> Iterator[Metric]:
        by = ["loop"]
        ticks = CounterMetricFamily("pal_loop_ticks", "Ticks of each leader loop", labels=by)
        secs = CounterMetricFamily("pal_loop_seconds", "Wall time of each leader loop's ticks", labels=by)
        rows = CounterMetricFamily("pal_loop_rows", "Store rows each leader loop read or changed", labels=by)
        stmts = CounterMetricFamily("pal_loop_statements", "Store statements of each leader loop", labels=by)
        worst = GaugeMetricFamily("pal_loop_max_seconds", "Slowest tick of each leader loop", labels=by)
        for name, st in sorted(self.loops.items()):
            ticks.add_metric([name], st.ticks)
            secs.add_metric([name], st.seconds)
            rows.add_metric([name], st.rows)
            stmts.add_metric([name], st.statements)
            worst.add_metric([name], st.max_seconds)
        yield from (ticks, secs, rows, stmts, worst)
