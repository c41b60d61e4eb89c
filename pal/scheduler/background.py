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
    """What the leader does besides reconciling: seal old secrets once, and each sweep pull
    the nodes' egress events, finish removed tenants and end lifetimes."""

    reseal_secrets: Callable[[], int]
    record_egress_events: Callable[[], Awaitable[int]]
    purge_deleted_tenants: Callable[[], Awaitable[Any]]
    end_lifetimes: Callable[[], Awaitable[Any]]  # lifetime.py: VMs past their lifetime


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
        elif not leads and st.leading:
            st.leading = False
            log.warning("not the leader any more: background loops stop, mutations are forwarded")
        if st.leading and st.reconcile_due:
            try:
                await self.nodes.refresh_local()
                await self.reconciler.reconcile_all()
                st.reconcile_due = False
                self.chores.reseal_secrets()
                await self.reconciler.sweep_snapshots()
            except Exception:
                log.exception("reconciliation after taking the lead failed; it is retried")

    async def _loop(self) -> None:
        tick = min(self.settings.idle_sweep_interval_s, self.leader.renew_interval_s, 1.0)
        last_sweep = last_nodes = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                await self.lead_once()
                if not self.state.leading:
                    continue
                now = time.monotonic()
                if now - last_nodes >= self.settings.node_heartbeat_interval_s:
                    last_nodes = now
                    await self.nodes.refresh_local()
                await self.reconciler.lose_silent_nodes()
                await self.reconciler.reconcile_unanswered()
                if now - last_sweep >= self.settings.idle_sweep_interval_s:
                    last_sweep = now
                    await self.reconciler.reconcile_light()
                    await self.sweeper.sweep()
                    await self.chores.end_lifetimes()
                    await self.chores.record_egress_events()
                    await self.chores.purge_deleted_tenants()
            except Exception:
                log.exception("scheduler background tick failed")
