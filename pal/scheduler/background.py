"""The leader's side of the scheduler: take (and keep) the lead, reconcile everything on
taking it (the previous leader may have died in the middle of any operation), and run the
periodic chores while leading: embedded nodes' heartbeats, node-loss detection,
reconciliation, the idle sweep, egress events, removed tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pal.config import Settings
from pal.scheduler.idle import IdleSweeper
from pal.scheduler.leader import Leadership
from pal.scheduler.loops import LoopClock
from pal.scheduler.nodes import NodePool
from pal.scheduler.reconcile import Reconciler

log = logging.getLogger(__name__)


@dataclass
class LeaderState:
    leading: bool = False
    since: float = 0.0  # clock() when this replica last became leader
    # The whole reconciliation after taking the lead still has to succeed.
    reconcile_due: bool = False


@dataclass(frozen=True)
class LeaderChores:
    """What the leader does besides reconciling, each sweep: seal old secrets (a page at a
    time, one pass per leadership), pull the nodes' egress events, finish removed tenants,
    end lifetimes, and retention (retention.py)."""

    reseal_secrets: Callable[[], int]
    reseal_again: Callable[[], None]  # a new leadership: one more pass
    record_egress_events: Callable[[], Awaitable[int]]
    purge_deleted_tenants: Callable[[], Awaitable[Any]]
    end_lifetimes: Callable[[], Awaitable[Any]]  # lifetime.py: VMs past their lifetime
    retention: Callable[[], Awaitable[Any]]  # retention.py: the list, old events
    audit_snapshots: Callable[[], Awaitable[Any]]  # snapshot_audit.py: a page of paused VMs
    sweep_snapshots: Callable[[], Awaitable[Any]]  # snapshot_audit.py: orphans, a node's page
    sweep_again: Callable[[], None]  # a new leadership: one more round of the sweep


@dataclass
class Background:
    settings: Settings
    leader: Leadership
    nodes: NodePool
    clock: Callable[[], float]
    reconciler: Reconciler
    sweeper: IdleSweeper
    chores: LeaderChores
    state: LeaderState
    loops: LoopClock
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pal-scheduler-loop")

    async def stop(self) -> None:
        """Stop the loop (the lease is kept until :meth:`release`)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def release(self) -> None:
        await self.leader.release()
        self.state.leading = False

    async def lead_once(self) -> None:
        """Acquire or renew the lease; on becoming leader, reconcile everything first."""
        st = self.state
        leads = await self.leader.acquire()
        if leads and not st.leading:
            st.leading = True
            st.since = self.clock()
            st.reconcile_due = True
            self.chores.reseal_again()
            self.chores.sweep_again()
        elif not leads and st.leading:
            st.leading = False
            self.reconciler.d.live.reset()  # others change VMs now: read again on taking over
            log.warning("not the leader any more: background loops stop, mutations are forwarded")
        if st.leading and st.reconcile_due:
            try:
                async with self.loops.tick("takeover"):
                    await self.nodes.refresh_local()
                    await self.reconciler.reconcile_all()
                st.reconcile_due = False
            except Exception:
                log.exception("reconciliation after taking the lead failed; it is retried")

    @property
    def reconciled(self) -> bool:
        """This replica leads and has settled every VM of every node that answered."""
        return self.state.leading and not self.state.reconcile_due and not self.reconciler.unreconciled_nodes

    async def sweep_once(self) -> None:
        """One sweep of every periodic chore (each timed and counted as its own loop)."""
        c = self.chores
        await self._chore("reconcile", self.reconciler.reconcile_light)
        await self._chore("idle_sweep", self.sweeper.sweep)
        await self._chore("lifetimes", c.end_lifetimes)
        await self._chore("egress_events", c.record_egress_events)
        await self._chore("tenant_purge", c.purge_deleted_tenants)
        await self._chore("retention", c.retention)
        await self._chore("snapshot_audit", c.audit_snapshots)
        await self._chore("snapshot_sweep", c.sweep_snapshots)
        await self._chore("reseal_secrets", self._reseal)

    async def _reseal(self) -> None:
        self.chores.reseal_secrets()

    async def _chore(self, name: str, chore: Callable[[], Awaitable[Any]]) -> None:
        async with self.loops.tick(name):
            await chore()

    async def _loop(self) -> None:
        tick = min(self.settings.idle_sweep_interval_s, self.leader.renew_interval_s, 1.0)
        last_sweep = last_nodes = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                async with self.loops.tick("lease"):
                    await self.lead_once()
                if not self.state.leading:
                    continue
                now = time.monotonic()
                if now - last_nodes >= self.settings.node_heartbeat_interval_s:
                    last_nodes = now
                    await self._chore("local_nodes", self.nodes.refresh_local)
                await self._chore("node_loss", self.reconciler.lose_silent_nodes)
                await self._chore("unanswered", self.reconciler.reconcile_unanswered)
                if now - last_sweep >= self.settings.idle_sweep_interval_s:
                    last_sweep = now
                    await self.sweep_once()
            except Exception:
                log.exception("scheduler background tick failed")
