"""Admission of restores (and boots) into new QEMUs by the CPU that is free on this node.

A restore is CPU work (TCG translates the guest's restore path afresh in every new QEMU).
Started all at once, N restores each get 1/N of the CPUs and every one of them is late;
admitted as CPU frees up, each runs at near full speed and the whole batch ends no later.
So a restore starts while fewer are in flight than the CPUs the rest of the host leaves
free (host_cpu.py: capacity less the other runnable tasks, times ``OVERCOMMIT``), never
more than PAL_FORK_CONCURRENCY, and never fewer than one per CPU: on a host busy with
others' work the kernel shares each CPU fairly between runnable tasks, and one restore
per CPU keeps a fan-out moving at that fair share (one in all would leave it a fraction). Waiters are admitted
first come, first served. Timeouts after admission stretch with the load
(host_cpu.Stretch), so a long queue slows children down but never fails them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator

from pal.vmm.host_cpu import LoadSampler

# A restore waits on I/O (disk clones, the network namespace, QMP) about half its time:
# twice the free CPUs keeps them busy without slicing each guest thinly.
OVERCOMMIT = 2.0
RECHECK_S = 0.1  # a full gate looks again this often (the others' load may have dropped)


class RestoreGate:
    def __init__(self, ceiling: int, sampler: LoadSampler | None = None) -> None:
        self.ceiling = max(1, ceiling)
        self.sampler = sampler or LoadSampler()
        self.sampler.own = lambda: self.in_flight
        self.in_flight = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        self.admitted_total = 0
        self.max_in_flight = 0

    def slots(self) -> int:
        """How many restores may run at once now."""
        load = self.sampler.sample()
        free = max(0.0, load.capacity - load.others)
        floor = max(1, math.floor(load.capacity))
        return min(self.ceiling, max(floor, math.floor(free * OVERCOMMIT)))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        await self._enter()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._wake()

    async def _enter(self) -> None:
        if not self._queue and self.in_flight < self.slots():
            self._take()
            return
        me: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(me)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(me), RECHECK_S)
                if me.done():
                    return  # admitted by _wake (in_flight already counted)
                self._wake()
        except BaseException:
            if me.done() and not me.cancelled():
                self.in_flight -= 1  # admitted, then cancelled before it could start
                self._wake()
            with contextlib.suppress(ValueError):
                self._queue.remove(me)
            raise

    def _take(self) -> None:
        self.in_flight += 1
        self.admitted_total += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _wake(self) -> None:
        """Admit waiters, oldest first, while there are slots."""
        while self._queue and self.in_flight < self.slots():
            fut = self._queue.popleft()
            if not fut.done():
                self._take()
                fut.set_result(None)
