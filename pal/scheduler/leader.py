"""Leadership: only the leader mutates VM state and runs the background loops (idle
sweeper, reconciliation, node-loss detection); followers serve reads and forward the rest.

Two implementations of one protocol:

- :class:`SingleProcessLeader` (SQLite, `pal up`): the only replica, always the leader.
- :class:`LeaseLeader` (PostgreSQL): a lease row (``leader_lease``) with a **fencing
  token**. A replica takes the lease only once it has expired by the database's clock, and
  each takeover increments the token. The leader renews every ``ttl/5``; it considers
  itself leader only until ``ttl - margin`` after the start of its last successful renewal
  (by its own monotonic clock), so it stops its loops before anyone else can take over.
  Whatever it still does after that is refused by the store: every write transaction
  checks the lease row's token against the leader's (:meth:`pal.store.Store.set_fence`).

Why a lease row rather than an advisory lock: the token is what makes a deposed leader's
late write fail, and a lease also deposes a leader that is alive but wedged. A kill -9
costs at most one TTL (5 s by default) before a follower takes over.

A *busy* leader is not a wedged one: under a heavy API load on a small machine its event
loop can be seconds late for the renewal tick, and a lease renewed only from the loop
then changes hands under load (the control-plane benchmark saw one failover a minute).
So the leader also renews from a thread of its own (:meth:`LeaseLeader.keep`), as long as
its event loop still turns (a pulse task on the loop stamps it every PULSE_S): a loop
that has not turned for ``ttl - margin`` is wedged, and its lease is left to run out.

Prerequisites / effects (each call):
- ``acquire()``: take or renew the lease. True if this replica leads now. Never raises on
  database errors (logged; the replica is then not leader).
- ``is_leader()``: whether this replica leads now (no I/O).
- ``release()``: give the lease up (clean shutdown); the next replica need not wait.
- ``leader_url()``: the advertised API URL of the current leader, or None if none holds an
  unexpired lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from typing import Protocol

from pal.store import Store

log = logging.getLogger(__name__)
PULSE_S = 0.25  # how often the event loop stamps that it turns (the keeper thread reads it)
LEADER_URL_TTL_S = 0.5  # a follower reads whom to forward to at most this often


class Leadership(Protocol):
    token: int | None

    async def acquire(self) -> bool:
        """Try to become (or stay) leader; True if this process now leads."""
        ...

    async def is_leader(self) -> bool: ...

    async def release(self) -> None: ...

    def keep(self) -> None:
        """Keep the lease while this process runs and its event loop turns (a thread)."""
        ...

    async def leader_url(self) -> str | None: ...

    @property
    def renew_interval_s(self) -> float: ...


class SingleProcessLeader:
    """The only replica (SQLite store): always the leader, no fencing needed."""

    token: int | None = 0
    renew_interval_s = 1.0

    async def acquire(self) -> bool:
        return True

    async def is_leader(self) -> bool:
        return True

    async def release(self) -> None:
        return None

    def keep(self) -> None:
        return None

    async def leader_url(self) -> str | None:
        return None


class LeaseLeader:
    """A lease row in PostgreSQL with a fencing token (see the module docstring)."""

    def __init__(self, store: Store, url: str, ttl_s: float = 5.0) -> None:
        self.store = store
        self.url = url
        self.ttl_s = ttl_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.token: int | None = None
        self._valid_until = 0.0  # monotonic
        self._lock = asyncio.Lock()
        self._guard = threading.Lock()  # the keeper thread's renewals against the loop's
        self._pulse_at = time.monotonic()  # when the event loop last turned
        self._kept_at = 0.0  # monotonic: the keeper thread's last renewal
        self.max_lag_s = 0.0  # the event loop's longest lateness seen by the pulse
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._pulse: asyncio.Task[None] | None = None
        self._url_read: tuple[float, str | None] | None = None  # (monotonic, leader url) last read
        store.set_fence(lambda: self.token)

    @property
    def renew_interval_s(self) -> float:
        return self.ttl_s / 5

    def _margin(self) -> float:
        return min(1.0, self.ttl_s / 5)

    def keep(self) -> None:
        """Start renewing from a thread of its own (and the event loop's pulse it checks);
        :meth:`release` stops both. Call from the event loop."""
        if self._keeper is not None:
            return
        self._pulse = asyncio.get_running_loop().create_task(self._beat(), name="pal-lease-pulse")
        self._keeper = threading.Thread(target=self._keep, name="pal-lease-keeper", daemon=True)
        self._keeper.start()

    async def _beat(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(PULSE_S)
            self._pulse_at = now = time.monotonic()
            self.max_lag_s = max(self.max_lag_s, now - before - PULSE_S)

    def _keep(self) -> None:
        while not self._stop.wait(self.renew_interval_s):
            if time.monotonic() - self._pulse_at > self.ttl_s - self._margin():
                continue  # the event loop is wedged: let the lease run out
            with self._guard:
                token = self.token
                if token is None:
                    continue
                started = time.monotonic()
                try:
                    if self.store.lease_renew(self.holder, token, int(self.ttl_s * 1000)):
                        self._valid_until = max(self._valid_until, started + self.ttl_s - self._margin())
                        self._kept_at = started
                except Exception as exc:
                    log.warning("leadership lease: renewal failed: %s", exc)

    async def acquire(self) -> bool:
        async with self._lock:
            started = time.monotonic()
            ttl_ms = int(self.ttl_s * 1000)
            try:
                if self.token is not None and started - self._kept_at < self.renew_interval_s / 2:
                    return await self.is_leader()  # the keeper renewed it just now
                if self.token is not None:
                    if await asyncio.to_thread(self._renew, self.token, ttl_ms):
                        self._valid_until = max(self._valid_until, started + self.ttl_s - self._margin())
                        return True
                    log.warning("leadership lost: the lease (token %s) was taken over", self.token)
                    self.token, self._url_read = None, None
                token = await asyncio.to_thread(self.store.lease_acquire, self.holder, self.url, ttl_ms)
            except Exception as exc:
                log.warning("leadership lease: database unreachable: %s", exc)
                if self.token is not None and time.monotonic() >= self._valid_until:
                    log.warning("leadership given up: could not renew the lease in time")
                    self.token = None
                return await self.is_leader()
            if token is None:
                return False
            self.token, self._url_read = token, None
            self._valid_until = started + self.ttl_s - self._margin()
            log.warning("this replica is now the leader (fencing token %d)", token)
            return True

    def _renew(self, token: int, ttl_ms: int) -> bool:
        with self._guard:
            return self.store.lease_renew(self.holder, token, ttl_ms)

    async def is_leader(self) -> bool:
        return self.token is not None and time.monotonic() < self._valid_until

    async def release(self) -> None:
        self._stop.set()
        if self._pulse is not None:
            self._pulse.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pulse
        async with self._lock:
            with self._guard:
                token, self.token, self._url_read = self.token, None, None
            if token is not None:
                try:
                    await asyncio.to_thread(self.store.lease_release, self.holder, token)
                except Exception as exc:
                    log.warning("could not release the leadership lease: %s", exc)

    async def leader_url(self) -> str | None:
        """Read at most every LEADER_URL_TTL_S: a follower forwards every request it cannot
        answer, and reading the lease for each was a statement per request."""
        now = time.monotonic()
        if self._url_read is not None and now - self._url_read[0] < LEADER_URL_TTL_S:
            return self._url_read[1]
        info = await asyncio.to_thread(self.store.lease_info)
        url = None if info.expires_in_ms <= 0 or not info.url else info.url
        self._url_read = (now, url)
        return url
