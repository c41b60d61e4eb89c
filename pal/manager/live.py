"""Live pause on the node (docs/live-pause.md): Pause, Offload and Resume of the
*same* QEMU, as opposed to the snapshot pause.

- **Pause**: the gateway holds the VM's connections (it keeps reading upstreams into a
  bounded buffer, then applies backpressure), then QMP ``stop``. The QEMU, its TCG
  translation cache, the guest's TCP connections and the incarnation stay.
- **Offload** (right away, or ``offload_after_ms`` later): the stopped guest's RAM is
  written back to its file and dropped (pal/vmm/offload.py); the pages that were resident
  are remembered as the working set.
- **Resume**: the working set is prefetched (readahead, in the background), QMP ``cont``,
  the guest's wall clock is set (it stood still: TCG's guest clocks stop with the vCPUs),
  then the gateway delivers what it held.

Every live pause is written to the VM's ``state.json`` before the call answers, so a
restarted manager adopts the QEMU as live-paused (not running) and re-arms what was due:
its offload, the guest's timer, and a wake if data arrived meanwhile (waits.py).

Wakes while paused come only to a *wait* pause (the guest waits on I/O): held data ready
by the VM's ``deliver`` rule (waits.py), or the guest's own nearest deadline (the harness
reports it: a ``sleep``, a socket timeout), so it never misses a deadline it set itself. An
idle pause (the live tier of idle suspend) is woken by requests only, like the snapshot
tier, and an operator's pause only by the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pal.errors import Conflict
from pal.guest import protocol as p
from pal.manager import guest_clock
from pal.manager import guest_input as gi
from pal.manager.channel import HarnessChannel
from pal.manager.notices import NoticeBoard
from pal.manager.vm import LivePause, LiveVm, VmRegistry
from pal.manager.vm_states import VmPhase, check_move
from pal.vmm import offload
from pal.wire.models import LivePauseRequest, LivePauseResult, LiveResumeResult, LiveState

log = logging.getLogger(__name__)

MIB = 1024 * 1024
PROBE_TIMEOUT_S = 2.0
CLOCK_TIMEOUT_S = 5.0
FILES_DRAIN_S = 10.0
PREFETCH_WAIT_S = 2.0  # a resume waits this long at most for the working set
# A guest's timer this close is not worth a pause: it would wake at once.
MIN_TIMER_MS = 20
WAITING = "wait"  # the one kind of pause that data and the guest's timers wake


class HeldNetwork(Protocol):
    """What a live pause asks of the egress gateway (vmnet.VmNetworking)."""

    async def hold(self, vm_id: str, *, if_waiting: bool = False) -> dict[str, Any]: ...

    async def deliver(self, vm_id: str) -> int: ...

    async def wait_state(self, vm_id: str | None = None) -> dict[str, Any]: ...


@dataclass
class PauseDeps:
    """What live pauses (and wait management, waits.py) need of the node."""

    registry: VmRegistry
    net: HeldNetwork
    notices: NoticeBoard


async def probe(channel: HarnessChannel) -> dict[str, Any]:
    """The guest's own view of its load (runnable tasks, CPU ticks, its nearest timer)."""
    reply, _ = await channel.request({"k": p.K_PROBE}, timeout=PROBE_TIMEOUT_S)
    return gi.probe(reply)


class LiveControl:
    """Pause, offload and resume of the node's live VMs (NodeRuntime delegates here)."""

    def __init__(self, deps: PauseDeps, watch_waits: Callable[[LiveVm], None]) -> None:
        self.registry, self.net, self.notices = deps.registry, deps.net, deps.notices
        self.watch_waits = watch_waits  # a resumed VM that still waits is watched again

    # ------------------------------------------------------------------ state

    @staticmethod
    def state(
        lv: LiveVm, ready: bool = False, resident: int | None = None, buffered: int = 0
    ) -> LiveState | None:
        live = lv.live
        if live is None:
            return None
        if resident is None and live.offloaded:
            resident = live.resident_after
        return LiveState(
            by=live.by,  # type: ignore[arg-type]
            since=live.since,
            offloaded=live.offloaded,
            resident_mib=None if resident is None else round(resident / MIB),
            freed_mib=round(live.freed / MIB),
            offload_ms=None if live.offload_ms is None else round(live.offload_ms, 1),
            ready=ready,
            buffered_bytes=buffered,
        )

    async def status(self, vm_id: str) -> LiveState | None:
        """The VM's live pause with its resident guest RAM measured now (None: running)."""
        lv = self.registry.live(vm_id)
        if lv.live is None:
            return None
        resident: int | None = None
        if lv.qemu.pid is not None:
            with contextlib.suppress(Exception):
                resident = await asyncio.to_thread(offload.resident_bytes, lv.qemu.pid, lv.qemu.mem_path)
        ready, buffered = False, 0
        with contextlib.suppress(Exception):
            ws = await self.net.wait_state(vm_id)
            ready, buffered = bool(ws.get("ready")), int(ws.get("buffered") or 0)
        return self.state(lv, ready=ready, resident=resident, buffered=buffered)

    # ------------------------------------------------------------------ pause

    async def pause(self, vm_id: str, req: LivePauseRequest) -> LivePauseResult:
        """Prerequisites: the VM is live on this node. Success: its vCPUs are stopped, its
        connections held, the pause recorded in state.json (``paused`` False: an
        ``if_waiting`` pause found nothing waiting, or the guest busy; nothing changed).
        Failure: the VM runs as before (connections delivered again)."""
        lv = self.registry.live(vm_id)
        async with lv.op_lock:
            t0 = time.perf_counter()
            if lv.live is not None:  # already live-paused: the operator takes it over / offloads it
                if req.by == "operator" and lv.live.by != "operator":
                    lv.live.by = "operator"
                    lv.live.wake_at = None  # an operator's pause is never woken by a timer
                if req.offload and not lv.live.offloaded:
                    await self._offload(lv)
                self._arm(lv)
                self.registry.write_state(lv)
                return LivePauseResult(paused=True, pause_ms=_ms(t0), state=self.state(lv))
            if lv.files_in_flight:
                if req.by != "operator":  # an automatic pause never holds up a request
                    return LivePauseResult(paused=False, pause_ms=_ms(t0))
                try:  # the operator's waits for file requests under way (they are short)
                    await asyncio.wait_for(lv.files_idle.wait(), FILES_DRAIN_S)
                except TimeoutError:
                    raise Conflict(f"VM {vm_id}: file requests did not finish; try again") from None
            held = await self.net.hold(vm_id, if_waiting=req.if_waiting)
            if not held.get("held"):
                return LivePauseResult(paused=False, pause_ms=_ms(t0))
            timer_ms: int | None = None
            try:
                if req.by == WAITING:
                    try:
                        pr = await probe(lv.channel)
                    except Exception as exc:  # a silent guest is not a reason to keep it running
                        log.info("VM %s: no probe before a live pause (%s)", vm_id, exc)
                        pr = None
                    if pr is not None:
                        if pr["runnable"] > 0:  # it computes after all
                            await self.net.deliver(vm_id)
                            return LivePauseResult(paused=False, pause_ms=_ms(t0))
                        timer_ms = pr["timer_ms"]
                        if timer_ms is not None and timer_ms < MIN_TIMER_MS:
                            await self.net.deliver(vm_id)
                            return LivePauseResult(paused=False, pause_ms=_ms(t0))
                check_move(lv, VmPhase.LIVE_PAUSED)
                await lv.qemu.pause()
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.net.deliver(vm_id)
                raise
            now = time.time()
            lv.live = LivePause(by=req.by, since=now)
            if timer_ms is not None:
                lv.live.wake_at = now + timer_ms / 1000
            if req.offload_after_ms is not None and not req.offload:
                lv.live.offload_at = now + req.offload_after_ms / 1000
            pause_ms = _ms(t0)
            self.registry.write_state(lv)
            if req.by == WAITING:
                # Data that came between the hold and the stop made the gateway say "ready"
                # while the VM was not paused yet (the watcher ignored it): wake it now.
                with contextlib.suppress(Exception):
                    if (await self.net.wait_state(vm_id)).get("ready"):
                        self.notices.post(vm_id, "wake", reason="data (during the pause)")
            if req.offload:
                await self._offload(lv)
            self._arm(lv)
            log.info("VM %s live-paused by %s in %.1f ms", vm_id, req.by, pause_ms)
            return LivePauseResult(paused=True, pause_ms=pause_ms, state=self.state(lv))

    # ------------------------------------------------------------------ offload

    async def _offload(self, lv: LiveVm) -> None:
        """Hand the stopped guest's RAM back (caller holds lv.op_lock)."""
        live = lv.live
        pid = lv.qemu.pid
        if live is None or pid is None or live.offloaded:
            return
        check_move(lv, VmPhase.OFFLOADED)
        res = await asyncio.to_thread(offload.offload, pid, lv.qemu.mem_path)
        live.offloaded, live.offload_at = True, None
        live.offload_ms, live.resident_after, live.freed = res.ms, res.resident_after, res.freed
        live.working_set = res.working_set
        self.registry.write_state(lv)
        log.info(
            "VM %s offloaded in %.0f ms: %d MiB freed, %d MiB still resident %s",
            lv.vm_id,
            res.ms,
            res.freed // MIB,
            res.resident_after // MIB,
            res.phases_ms,
        )
        self.notices.post(
            lv.vm_id,
            "offloaded",
            ms=round(res.ms, 1),
            freed_mib=round(res.freed / MIB),
            resident_mib=round(res.resident_after / MIB),
            since=live.since,
            by=live.by,
        )

    async def _offload_later(self, lv: LiveVm, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.time()))
        async with lv.op_lock:
            if lv.live is not None and not lv.qemu.exited.is_set():
                try:
                    await self._offload(lv)
                except Exception as exc:
                    log.warning("VM %s: offload failed: %s", lv.vm_id, exc)

    async def _wake_later(self, lv: LiveVm, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.time()))
        if lv.live is not None and lv.live.by == WAITING:
            self.notices.post(lv.vm_id, "wake", reason="timer")

    def _arm(self, lv: LiveVm) -> None:
        """(Re)start the timers a live pause has: its offload, the guest's deadline."""
        live = lv.live
        if live is None:
            return
        live.cancel_timers()
        if live.offload_at is not None and not live.offloaded:
            self._task(live, self._offload_later(lv, live.offload_at), f"offload-{lv.vm_id}")
        if live.wake_at is not None and live.by == WAITING:
            self._task(live, self._wake_later(lv, live.wake_at), f"wake-{lv.vm_id}")

    @staticmethod
    def _task(live: LivePause, coro: Any, name: str) -> None:
        t = asyncio.create_task(coro, name=name)
        live.tasks.add(t)
        t.add_done_callback(live.tasks.discard)

    # ------------------------------------------------------------------ resume

    async def resume(self, vm_id: str) -> LiveResumeResult:
        """Prerequisites: the VM is live on this node. Success: its vCPUs run, its wall
        clock is the host's, the gateway delivered what it held (``resumed`` False: it
        was not live-paused; nothing changed). Failure: QEMU died (the caller loses it)."""
        lv = self.registry.live(vm_id)
        async with lv.op_lock:
            return await self._resume_locked(lv)

    async def _resume_locked(self, lv: LiveVm, *, running: bool = False) -> LiveResumeResult:
        live = lv.live
        if live is None:
            return LiveResumeResult(resumed=False)
        check_move(lv, VmPhase.RUNNING)
        t0 = time.perf_counter()
        live.cancel_timers()
        phases: dict[str, float] = {}
        prefetch = self.start_prefetch(lv)
        if prefetch is not None and not running:
            # The working set back in the page cache before the vCPUs run: the guest then
            # takes minor faults only (a guest faulting its pages in one by one through
            # the file system is several times slower than this one batched read).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(prefetch), PREFETCH_WAIT_S)
            phases["prefetch"] = _ms(t0)
        if not running:
            await lv.qemu.cont()
        phases["cont"] = _ms(t0)
        await self._set_clock(lv)
        phases["clock"] = _ms(t0)
        buffered = 0
        try:
            buffered = await self.net.deliver(lv.vm_id)
        except Exception as exc:
            log.warning("VM %s: the gateway did not deliver what it held: %s", lv.vm_id, exc)
        phases["deliver"] = _ms(t0)
        paused_ms = int((time.time() - live.since) * 1000)
        lv.live = None
        # Woken while a connection still waits (a timer, a request)? Watch it again: no new
        # "waiting" edge will come for a connection that never stopped waiting.
        self.watch_waits(lv)
        lv.live_paused_ms_total += paused_ms
        lv.resumed_at = time.monotonic()
        self.registry.write_state(lv)
        res = LiveResumeResult(
            resumed=True,
            resume_ms=_ms(t0),
            paused_ms=paused_ms,
            offloaded=live.offloaded,
            freed_mib=round(live.freed / MIB),
            buffered_bytes=buffered,
        )
        log.info(
            "VM %s live-resumed in %.1f ms after %d ms (%s; cumulative ms %s)",
            lv.vm_id,
            res.resume_ms,
            paused_ms,
            live.by,
            phases,
        )
        return res

    def start_prefetch(self, lv: LiveVm) -> asyncio.Task[int] | None:
        """Read an offloaded VM's working set back (once per pause; a wake for data starts
        it as soon as the data is ready, before the scheduler asks for the resume)."""
        live = lv.live
        if live is None or not live.offloaded or not live.working_set:
            return None
        if live.prefetch is None:
            live.prefetch = asyncio.create_task(
                asyncio.to_thread(offload.prefetch, lv.qemu.mem_path, live.working_set),
                name=f"prefetch-{lv.vm_id}",
            )
            live.prefetch.add_done_callback(_log_failure(lv.vm_id, "prefetch"))
        return live.prefetch

    async def _set_clock(self, lv: LiveVm) -> None:
        try:
            reply, _ = await lv.channel.request(
                {"k": p.K_CLOCK, "now_ns": time.time_ns()}, timeout=CLOCK_TIMEOUT_S
            )
            await guest_clock.correct(lv.channel, reply.get("result") or {}, time.time_ns())
        except Exception as exc:  # the guest runs; its clock is its problem
            log.warning("VM %s: clock not set after a live resume: %s", lv.vm_id, exc)

    async def end_after_capture(self, lv: LiveVm, *, running: bool) -> None:
        """A snapshot pause of a live-paused VM failed: the VM runs again (``running``:
        QEMU already continued it), its live pause ended like a resume. Caller holds
        lv.op_lock."""
        await self._resume_locked(lv, running=running)

    def forget(self, vm_id: str) -> None:
        """The VM is going away: stop its timers."""
        lv = self.registry.vms.get(vm_id)
        if lv is not None and lv.live is not None:
            lv.live.cancel_timers()

    # ------------------------------------------------------------------ after a restart

    async def rearm_all(self) -> None:
        """A restarted manager: re-arm every adopted live pause (offload, timer), and post
        a wake for each wait pause whose held data (or timer) came while nobody watched."""
        try:
            states = await self.net.wait_state()
        except Exception as exc:
            log.warning("gateway wait states unknown after a restart: %s", exc)
            states = {}
        for lv in list(self.registry.vms.values()):
            if lv.live is None:
                continue
            self._arm(lv)
            st = states.get(lv.vm_id) or {}
            if lv.live.by != WAITING:
                continue
            if st.get("ready"):
                self.notices.post(lv.vm_id, "wake", reason=f"data ({st.get('ready')})")
            elif lv.live.wake_at is not None and lv.live.wake_at <= time.time():
                self.notices.post(lv.vm_id, "wake", reason="timer")


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


def _log_failure(vm_id: str, what: str) -> Any:
    def done(t: asyncio.Task[Any]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.info("VM %s: %s failed: %s", vm_id, what, t.exception())

    return done
