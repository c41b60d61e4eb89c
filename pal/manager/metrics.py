"""Per-VM resource samples kept on the node: the last 15 minutes, one sample every 5 s.

The runtime manager owns the VMs, so it samples them (sampling.py ``Sampler.run``) and
serves the series over its RPC (``GET /vms/{id}/metrics``). Where each figure comes from:

- ``cpuPct``: CPU time of the VM's cgroup (v2 ``cpu.stat`` usage_usec, v1
  ``cpuacct.usage``; ``/proc/<pid>/stat`` where cgroups are off) between two samples, in %
  of one host core (a 2-vCPU VM can show up to 200 %).
- ``rssBytes``, ``pssBytes``: ``/proc/<qemu pid>/smaps_rollup``, host memory of the QEMU
  process; PSS splits pages shared with forks of one snapshot among them.
- ``guestMemUsedBytes``, ``guestMemTotalBytes``: the guest harness's heartbeat,
  ``MemTotal - MemAvailable`` of the guest's /proc/meminfo.
- ``diskUsedBytes``, ``diskTotalBytes``: the guest harness's heartbeat, ``statvfs`` of the
  guest's /workspace file system.
- ``netRxBytes``, ``netTxBytes``: the node's network counters when a network provider
  reports them (``Sampler.net_counters``: the gateway's), else null.
- ``livePausedMs``: time live-paused in the interval, once live pause exists; else null.

Guest figures are what the guest says about itself: they are shown for that VM only and
are never used for a decision. They are dropped when the heartbeat is stale (older than
three sample intervals), so a hung guest shows gaps, not frozen values.

Memory is bounded: at most ``WINDOW_S / interval`` samples per VM, and the series of a VM
that stopped (paused, deleted) is kept for one window, so its last figures stay visible,
then dropped; at most ``MAX_SERIES`` series are kept in all.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pal.wire.models import MetricSample, VmMetrics

SAMPLE_INTERVAL_S = 5.0
WINDOW_S = 15 * 60.0
MAX_SERIES = 2000  # live + recently stopped VMs whose series are kept
# Guest-reported values larger than this are nonsense (a hostile or broken guest).
MAX_GUEST_BYTES = 1 << 50


def _guest_bytes(hb: dict[str, object], name: str) -> int | None:
    v = hb.get(name)
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_GUEST_BYTES:
        return v
    return None


@dataclass
class RawReading:
    """One reading of a live VM, before it becomes a sample (CPU needs two readings)."""

    at: float  # unix seconds
    mono: float  # monotonic seconds, for the CPU rate
    cpu_ns: int | None
    rss_bytes: int | None = None
    pss_bytes: int | None = None
    heartbeat: dict[str, object] | None = None  # the latest, when fresh
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None
    live_paused_ms: int | None = None


@dataclass
class _Series:
    samples: deque[MetricSample]
    last: RawReading | None = None
    incarnation_key: object = None
    stopped_at: float | None = None  # monotonic; None while the VM lives
    cpu_source: str = ""


@dataclass
class MetricsBook:
    """The bounded per-VM rings. Not thread-safe: used from the manager's event loop."""

    interval_s: float = SAMPLE_INTERVAL_S
    window_s: float = WINDOW_S
    max_series: int = MAX_SERIES
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    _series: OrderedDict[str, _Series] = field(default_factory=OrderedDict)

    @property
    def capacity(self) -> int:
        return max(1, int(self.window_s / self.interval_s))

    def record(self, vm_id: str, reading: RawReading, *, process_key: object, cpu_source: str = "") -> None:
        """Add a sample for ``vm_id``. ``process_key`` identifies the QEMU process: the CPU
        counter restarts with a new process, so no rate is computed across two of them."""
        s = self._series.get(vm_id)
        if s is None:
            s = _Series(samples=deque(maxlen=self.capacity))
            self._series[vm_id] = s
        self._series.move_to_end(vm_id)
        s.stopped_at = None
        cpu_pct: float | None = None
        prev = s.last
        if (
            prev is not None
            and s.incarnation_key == process_key
            and prev.cpu_ns is not None
            and reading.cpu_ns is not None
            and reading.mono > prev.mono
        ):
            used = max(0, reading.cpu_ns - prev.cpu_ns)
            cpu_pct = round(100.0 * used / ((reading.mono - prev.mono) * 1e9), 2)
        s.last, s.incarnation_key, s.cpu_source = reading, process_key, cpu_source
        hb = reading.heartbeat or {}
        s.samples.append(
            MetricSample(
                t=int(reading.at * 1000),
                cpu_pct=cpu_pct,
                rss_bytes=reading.rss_bytes,
                pss_bytes=reading.pss_bytes,
                guest_mem_used_bytes=_guest_bytes(hb, "mem_used"),
                guest_mem_total_bytes=_guest_bytes(hb, "mem_total"),
                disk_used_bytes=_guest_bytes(hb, "disk_used"),
                disk_total_bytes=_guest_bytes(hb, "disk_total"),
                net_rx_bytes=reading.net_rx_bytes,
                net_tx_bytes=reading.net_tx_bytes,
                live_paused_ms=reading.live_paused_ms,
            )
        )
        self._trim()

    def stopped(self, vm_id: str) -> None:
        """The VM left this node: keep its series for one window, then forget it."""
        s = self._series.get(vm_id)
        if s is not None and s.stopped_at is None:
            s.stopped_at = self.clock()
            s.last = None  # a resumed VM is a new process: no CPU rate across the gap

    def expire(self) -> None:
        now = self.clock()
        for vm_id in [
            k for k, s in self._series.items() if s.stopped_at and now - s.stopped_at > self.window_s
        ]:
            del self._series[vm_id]

    def _trim(self) -> None:
        while len(self._series) > self.max_series:
            # Oldest-touched first, preferring series of stopped VMs.
            victim = next((k for k, s in self._series.items() if s.stopped_at is not None), None)
            if victim is None:
                victim = next(iter(self._series))
            del self._series[victim]

    def series(self, vm_id: str, live: bool) -> VmMetrics:
        """The VM's samples, oldest first; an empty series for a VM never sampled here.
        ``live``: whether the VM runs on this node now (the caller knows)."""
        s = self._series.get(vm_id)
        cutoff_ms = int((self.wall() - self.window_s) * 1000)
        samples = [x for x in s.samples if x.t >= cutoff_ms] if s else []
        return VmMetrics(
            vm_id=vm_id,
            interval_secs=self.interval_s,
            window_secs=self.window_s,
            live=live,
            cpu_source=(s.cpu_source or None) if s else None,
            samples=samples,
        )

    def known(self) -> list[str]:
        return list(self._series)
