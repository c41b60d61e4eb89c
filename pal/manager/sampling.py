"""Metrics sampling of the live VMs (metrics.py keeps the series): CPU, memory, network
bytes, the guest's heartbeat, live-paused time; and the host-observed network activity
that idle suspend counts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pal.manager.metrics import MetricsBook, RawReading
from pal.manager.vm import LiveVm, VmRegistry
from pal.vmm import usage
from pal.wire.models import VmMetrics

log = logging.getLogger(__name__)

# Per-VM network byte counters (rx, tx): the gateway's, refreshed before each round.
NetCounters = Callable[[str], tuple[int, int] | None]


class Sampler:
    def __init__(
        self,
        registry: VmRegistry,
        metrics: MetricsBook,
        heartbeat_interval_s: float,
        net_counters: NetCounters | None,
        refresh_counters: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.heartbeat_interval_s = heartbeat_interval_s
        self.net_counters = net_counters
        self.refresh_counters = refresh_counters  # vmnet.VmNetworking.refresh_counters

    async def run(self) -> None:
        """Sample every live VM each ``metrics_interval_s`` until cancelled."""
        interval = self.metrics.interval_s
        next_at = time.monotonic()
        while True:
            try:
                await self.sample_once()
            except Exception:
                log.exception("metrics sampling failed")
            next_at += interval
            # On a loaded host a late tick is not made up twice: sample at the next slot.
            next_at = max(next_at, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    def _net(self, vm_id: str) -> tuple[int, int] | None:
        if self.net_counters is None:
            return None
        try:
            return self.net_counters(vm_id)
        except Exception:
            return None

    async def sample_once(self) -> None:
        live = self.registry.alive()
        if self.refresh_counters is not None:
            await self.refresh_counters()
        self.stamp_network_activity(live)
        for vm_id, lv in list(self.registry.vms.items()):
            if lv.qemu.exited.is_set():
                self.metrics.stopped(vm_id)
        hb_max_age = 3 * max(self.heartbeat_interval_s, self.metrics.interval_s)
        readings = await asyncio.to_thread(
            lambda: [_read(lv, hb_max_age, self._net(lv.vm_id)) for lv in live]
        )
        for lv, reading in zip(live, readings, strict=True):
            if self.registry.vms.get(lv.vm_id) is lv:  # not stopped while we read
                source = "cgroup" if lv.qemu.cgroup is not None else "proc"
                self.metrics.record(
                    lv.vm_id, reading, process_key=(lv.qemu.pid, id(lv.qemu)), cpu_source=source
                )
        self.metrics.expire()

    def stamp_network_activity(self, live: list[LiveVm]) -> None:
        """Bytes the egress gateway moved for a running guest since the last sample are
        activity the host saw (scheduler/idle.py), like an exec: a guest busy on the
        network is not idle, whatever its heartbeat says. A live-paused guest moves none
        itself (the gateway may hold bytes for it: waits.py decides about those)."""
        now_ms = int(time.time() * 1000)
        for lv in live:
            moved = self._net(lv.vm_id)
            if moved is None:
                continue
            if lv.net_bytes is not None and moved != lv.net_bytes and lv.live is None:
                lv.last_activity_ms = max(lv.last_activity_ms, now_ms)
            lv.net_bytes = moved

    def vm_metrics(self, vm_id: str) -> VmMetrics:
        """The VM's last samples (an empty series when this node never ran it)."""
        lv = self.registry.vms.get(vm_id)
        return self.metrics.series(vm_id, live=lv is not None and not lv.qemu.exited.is_set())


def _memory(lv: LiveVm, pid: int) -> usage.ProcessMemory | None:
    """The QEMU's RSS and PSS. Reading smaps_rollup walks its page tables, which costs a
    node with hundreds of idle VMs a good part of a core (docs/benchmarks/density.md), and a
    live-paused QEMU's memory changes only when its offload runs: read once per state."""
    live = lv.live
    if live is not None and live.sampled_memory is not None and live.sampled_memory[0] == live.offloaded:
        return live.sampled_memory[1]
    mem = usage.process_memory(pid)
    if live is not None:
        live.sampled_memory = (live.offloaded, mem)
    return mem


def _read(lv: LiveVm, hb_max_age_s: float, net: tuple[int, int] | None) -> RawReading:
    """One VM's reading, taken off the event loop (smaps_rollup walks page tables)."""
    pid = lv.qemu.pid
    cpu, _ = usage.cpu_ns(pid, lv.qemu.cgroup) if pid else (None, "")
    mem = _memory(lv, pid) if pid else None
    hb = lv.channel.heartbeat  # cleaned by the channel (guest_input.heartbeat)
    fresh = hb is not None and time.monotonic() - lv.channel.heartbeat_at <= hb_max_age_s
    paused = lv.paused_ms()
    paused_delta, lv.sampled_paused_ms = max(0, paused - lv.sampled_paused_ms), paused
    return RawReading(
        at=time.time(),
        mono=time.monotonic(),
        cpu_ns=cpu,
        rss_bytes=mem.rss_bytes if mem else None,
        pss_bytes=mem.pss_bytes if mem else None,
        heartbeat=dict(hb) if fresh and hb is not None else None,
        net_rx_bytes=net[0] if net else None,
        net_tx_bytes=net[1] if net else None,
        live_paused_ms=paused_delta,
    )
