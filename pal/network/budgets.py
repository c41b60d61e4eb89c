"""Budgets in the egress gateway: what one VM may take of the node's shared resources, and
what the node (the gateway process) gives out in all, so that no tenant starves another.

- **Lookups in flight** (:class:`Slots`): each VM has ``VM_LOOKUPS``, the node
  ``NODE_LOOKUPS``; a lookup waits (FIFO) for a slot of its VM, then one of the node's.
  A VM's waiting lookups queue on its own slots, never ahead of another VM's.
- **Buffered bytes and descriptors** (:class:`Pool` of :class:`Account`): a VM may take up
  to its own limit, and the node's total is capped. Each VM is guaranteed a floor (its
  first ``*_FLOOR``), so one that fills the node's pool cannot stall another's first
  connections or first bytes. Bytes are enforced with backpressure (a connection over
  budget stops reading: TCP pushes back on the sender, nothing is dropped), descriptors by
  refusing new connections (reset, with an ``egress_denied`` event).

The node totals are the operator's (PAL_GATEWAY_MAX_*, pal/config.py NetBudgets, with
their defaults); PAL_MAX_* cap what a spec may ask for (pal/scheduler/ceilings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from collections import deque
from collections.abc import AsyncIterator, Callable

VM_LOOKUPS = 8  # upstream lookups in flight per VM
NODE_LOOKUPS = 64  # per node
VM_FD_FLOOR = 64  # descriptors every VM may have whatever the node's pool holds (32 connections)
VM_BYTES_FLOOR = 1 << 20  # buffered bytes every VM may have whatever the node's pool holds
FD_RESERVE = 1024  # the gateway's own: control, each VM's listener and DNS socket, lookups
FDS_PER_CONNECTION = 2  # the guest's socket and the upstream's (brokered: two more)


def node_descriptors(max_connections: int | None = None) -> int:
    """Descriptors the node's connections may use in all: the operator's
    PAL_GATEWAY_MAX_CONNECTIONS, within what the process may open (RLIMIT_NOFILE) less
    the gateway's own reserve."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = max(FDS_PER_CONNECTION, soft - FD_RESERVE)
    if max_connections:
        return min(room, max_connections * FDS_PER_CONNECTION)
    return room


class Slots:
    """At most ``limit`` holders at once; the others wait in arrival order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        if self.in_use < self.limit and not self._waiters:
            self._take()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over: in_use already counts us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def _take(self) -> None:
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.in_use -= 1

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


class Pool:
    """A node total shared by accounts. Each account's use up to its floor is its own;
    only what it uses beyond the floor is drawn from the shared part (the total less the
    floors). Floors are guaranteed even when they add up to more than the total (each is
    small beside the guest RAM a VM costs)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.floors = 0
        self.beyond = 0  # use beyond floors, all accounts together
        self.accounts: set[Account] = set()

    @property
    def shared_free(self) -> int:
        return max(0, self.total - self.floors) - self.beyond

    def resize(self, total: int) -> None:
        self.total = total
        self._wake()

    def _wake(self) -> None:
        for acct in list(self.accounts):
            acct.wake()


class Account:
    """One VM's use of a :class:`Pool`: up to ``limit``, ``floor`` of it guaranteed.

    ``take`` charges what has already arrived (bytes are never refused once read);
    ``has_room`` says whether more may come. Whoever stopped for want of room registers a
    callback with ``wait_for_room``; it is called when room comes back."""

    def __init__(self, pool: Pool, limit: int, floor: int) -> None:
        self.pool = pool
        self.limit = limit
        self.wanted_floor = floor
        self.floor = min(floor, limit)
        self.used = 0
        self._waiters: list[Callable[[], None]] = []
        pool.floors += self.floor
        pool.accounts.add(self)

    def _beyond(self, used: int) -> int:
        return max(0, used - self.floor)

    def fits(self, n: int) -> bool:
        """Could ``n`` more be taken within this account's limit and the node's pool?"""
        extra = self._beyond(self.used + n) - self._beyond(self.used)
        return self.used + n <= self.limit and extra <= self.pool.shared_free

    def has_room(self) -> bool:
        return self.fits(1)

    def take(self, n: int) -> None:
        self.pool.beyond += self._beyond(self.used + n) - self._beyond(self.used)
        self.used += n

    def give(self, n: int) -> None:
        n = min(n, self.used)
        if n <= 0:
            return
        self.pool.beyond -= self._beyond(self.used) - self._beyond(self.used - n)
        self.used -= n
        self.pool._wake()  # room in the pool may let other VMs' connections go on

    def set_limit(self, limit: int) -> None:
        self.pool.floors -= self.floor
        self.pool.beyond -= self._beyond(self.used)
        self.limit, self.floor = limit, min(self.wanted_floor, limit)
        self.pool.floors += self.floor
        self.pool.beyond += self._beyond(self.used)
        self.wake()

    def wait_for_room(self, callback: Callable[[], None]) -> None:
        if callback not in self._waiters:
            self._waiters.append(callback)

    def forget(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(callback)

    def wake(self) -> None:
        """Call waiters in order while there is room (each may take some and stop again)."""
        while self._waiters and self.has_room():
            self._waiters.pop(0)()

    def close(self) -> None:
        if self not in self.pool.accounts:
            return
        self.pool.beyond -= self._beyond(self.used)
        self.pool.floors -= self.floor
        self.used = 0
        self._waiters.clear()
        self.pool.accounts.discard(self)
        self.pool._wake()
