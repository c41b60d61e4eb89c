"""Latency histograms of the scheduler's operations, for the operator's /metrics.

Recorded where the scheduler does the work (one place per operation); exposed by
``pal.api.prometheus`` with the gauges it reads at scrape time. Each Scheduler has its own
registry, so tests and several schedulers in one process do not share counts.

- ``pal_schedule_seconds{boot=template|cold}``: the schedule call, reservation to running.
- ``pal_pause_seconds{by=operator|idle}``: the pause, running to paused.
- ``pal_resume_seconds{trigger=api|wake}``: the resume, paused to running (wake: done for
  an exec or file request).
- ``pal_live_pause_seconds{by=operator|idle|wait}``: a live pause, running to live-paused
  (vCPUs stopped; an offload asked with it included).
- ``pal_live_resume_seconds{trigger=api|wake|data|timer|port}``: a live resume (the same QEMU
  continues; wake: for an exec, file or port request).
- ``pal_fork_seconds``: the fork call, reservation to the last child settled.
- ``pal_first_exec_seconds{after=schedule|resume|wake|fork|live-wake}``: the first exec of a
  VM's new incarnation (or after a live wake), from the request to its first event (a
  wake's includes the resume).
- ``pal_loop_{ticks,seconds,rows,statements}{loop}``, ``pal_loop_max_seconds{loop}``: the
  leader's loops, tick by tick (loops.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from pal.scheduler.loops import LoopClock

# TCG guests: tens of ms (a warm exec) to a minute (a cold boot on a loaded host).
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

        def hist(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=BUCKETS, registry=self.registry)

        self.schedule = hist("pal_schedule_seconds", "Schedule latency (to a running VM)", ("boot",))
        self.pause = hist("pal_pause_seconds", "Pause latency (snapshot and stop)", ("by",))
        self.resume = hist("pal_resume_seconds", "Resume latency (restore to running)", ("trigger",))
        self.live_pause = hist("pal_live_pause_seconds", "Live pause latency (vCPUs stopped)", ("by",))
        self.live_resume = hist(
            "pal_live_resume_seconds", "Live resume latency (the same QEMU continues)", ("trigger",)
        )
        self.fork = hist("pal_fork_seconds", "Fork latency (all children settled)")
        self.first_exec = hist(
            "pal_first_exec_seconds", "First exec after a VM (re)started, to its first event", ("after",)
        )
        # Each leader loop's ticks: time, CPU, store statements and rows (pal_loop_*).
        self.loops = LoopClock()
        self.registry.register(self.loops)
        # vm id -> how its current incarnation started, until its first exec is measured
        self._fresh: dict[str, str] = {}

    def started(self, vm_id: str, how: str) -> None:
        self._fresh[vm_id] = how

    def first_exec_done(self, vm_id: str, seconds: float) -> None:
        how = self._fresh.pop(vm_id, None)
        if how is not None:
            self.first_exec.labels(after=how).observe(seconds)

    def forget(self, vm_id: str) -> None:
        self._fresh.pop(vm_id, None)
