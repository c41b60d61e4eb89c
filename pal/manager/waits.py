"""Automatic wait management, node side: notice when a guest is idle and waits on I/O the
egress gateway holds, and when its data is ready (docs/live-pause.md).

The scheduler owns the decision (the transition table); the node watches, because only it
sees the gateway and the guest quickly enough:

1. The gateway says a VM with ``waitPause`` has a connection *waiting* on its upstream
   (request sent, no response byte delivered since). A pending request alone is not
   enough (the spec says so), so:
2. the node probes the guest twice, ``afterMs`` apart (protocol ``probe``): no task
   runnable (besides the prober) at either probe, the guest's CPU at most
   ``IDLE_MAX_BUSY`` busy in between, no exec output and no new exec/file request since the
   first probe, and still a connection waiting. Then it posts ``wait-ready``; the
   scheduler live-pauses the VM (the manager checks the wait and the guest once more,
   atomically with the hold in the gateway). While the guest stays busy and waiting, the
   node looks again every ``afterMs``.
3. While the VM is paused the gateway buffers its upstreams; when the data is ready by the
   VM's ``deliver`` rule it says so and the node posts ``wake`` (live.py posts the timer
   wakes). The scheduler resumes the VM.

Cost: nothing for a VM that does not wait; two probes (a few ms of guest CPU each) per
``afterMs`` while one waits and is not idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from pal.manager.live import PauseDeps, probe
from pal.manager.vm import LiveVm

log = logging.getLogger(__name__)

IDLE_MAX_BUSY = 0.2  # guest CPU busy fraction between the probes still counted idle


class WaitWatcher:
    def __init__(self, deps: PauseDeps, prefetch: Callable[[LiveVm], object]) -> None:
        self.registry, self.net, self.notices = deps.registry, deps.net, deps.notices
        self.prefetch = prefetch  # live.LiveControl.start_prefetch: while the scheduler decides
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ gateway events

    def on_gateway_event(self, ev: dict[str, Any]) -> None:
        vm_id, kind = str(ev.get("vmId") or ""), ev.get("ev")
        lv = self.registry.vms.get(vm_id)
        if lv is None:
            return
        if kind == "waiting":
            self.watch(lv)
        elif kind == "ready" and lv.live is not None and lv.live.by == "wait":
            self.notices.post(vm_id, "wake", reason=f"data ({ev.get('reason')})")
            self.prefetch(lv)  # while the scheduler decides

    def watch(self, lv: LiveVm) -> None:
        if lv.wait is None or lv.live is not None:
            return
        task = self._tasks.get(lv.vm_id)
        if task is None or task.done():
            self._tasks[lv.vm_id] = asyncio.create_task(self._watch(lv), name=f"wait-watch-{lv.vm_id}")

    def forget(self, vm_id: str) -> None:
        task = self._tasks.pop(vm_id, None)
        if task is not None:
            task.cancel()

    async def start(self) -> None:
        """After a (re)start: watch the running VMs whose connections already wait."""
        try:
            states = await self.net.wait_state()
        except Exception as exc:
            log.warning("gateway wait states unknown: %s", exc)
            return
        for vm_id, st in states.items():
            lv = self.registry.vms.get(vm_id)
            if lv is not None and st.get("waiting") and not st.get("held"):
                self.watch(lv)

    # ------------------------------------------------------------------ the check

    async def _waiting(self, vm_id: str) -> bool:
        st = await self.net.wait_state(vm_id)
        return bool(st.get("waiting")) and not st.get("held")

    async def _watch(self, lv: LiveVm) -> None:
        try:
            while self._current(lv) and lv.wait is not None:
                if await self.idle_and_waiting(lv, lv.wait.after_ms / 1000):
                    self.notices.post(lv.vm_id, "wait-ready")
                    # The scheduler pauses it (or not: an exec in flight); look again after
                    # one more window unless it did.
                    await asyncio.sleep(lv.wait.after_ms / 1000)
                if not await self._waiting(lv.vm_id):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("VM %s: wait watch ended: %s", lv.vm_id, exc)
        finally:
            with contextlib.suppress(KeyError):
                if self._tasks.get(lv.vm_id) is asyncio.current_task():
                    del self._tasks[lv.vm_id]

    def _current(self, lv: LiveVm) -> bool:
        return self.registry.vms.get(lv.vm_id) is lv and lv.live is None and not lv.qemu.exited.is_set()

    async def idle_and_waiting(self, lv: LiveVm, window_s: float) -> bool:
        """Probe, wait ``window_s``, probe: is the guest idle all along and does one of its
        connections still wait on its upstream?"""
        t0_mono, t0_ms = time.monotonic(), int(time.time() * 1000)
        first = await probe(lv.channel)
        await asyncio.sleep(window_s)
        if not self._current(lv) or not await self._waiting(lv.vm_id):
            return False
        second = await probe(lv.channel)
        ticks = second["cpu_total"] - first["cpu_total"]
        busy = (second["cpu_busy"] - first["cpu_busy"]) / ticks if ticks > 0 else 0.0
        quiet_host = lv.last_output_mono < t0_mono and lv.last_activity_ms < t0_ms
        idle = first["runnable"] == 0 and second["runnable"] == 0 and busy <= IDLE_MAX_BUSY and quiet_host
        log.info(
            "VM %s wait check: runnable %d/%d, busy %.2f, host quiet %s -> %s",
            lv.vm_id,
            first["runnable"],
            second["runnable"],
            busy,
            quiet_host,
            idle,
        )
        return idle
