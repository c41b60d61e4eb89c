"""The runtime scheduler's composition root: it builds one object per operation, once,
and hands each the parts it needs; the API, the dashboard and `pal up`/`pal server`
(pal/server.py) call those objects themselves (``scheduler.pauses.pause(...)``), each typed,
through no forwarding layer. The work, the checks and the docs of each operation are in
its module:

| operation                                     | module            |
| --------------------------------------------- | ----------------- |
| schedule                                      | schedule.py       |
| pause, resume, the idle sweeper's tiers       | pause_resume.py   |
| live pause and resume, wait management, wakes | live.py           |
| fork                                          | fork.py           |
| delete, removed tenants                       | delete.py         |
| every guest verb: exec, files, ports, processes, code | guest.py   |
| a request's resolved VM, its wake, in flight  | wake.py           |
| egress policy and brokered secrets            | egress_secrets.py |
| node drain, server shutdown                   | drain.py          |
| reads (VMs, events, metrics, images, nodes)   | reads.py          |
| clients' audit events (MCP tool calls)        | audit.py          |
| paged reads (VMs by metadata, events)         | listing.py        |
| lifetimes (their end, PUT lifetime)           | lifetime.py       |
| reconciliation, node loss, node heartbeats    | reconcile.py      |
| the idle sweeper                              | idle.py           |
| leadership and the leader's periodic chores   | background.py     |

Shared by all of them (deps.py): the store, the per-VM locks and in-flight counts, the
node clients, the transition function (transition.py, checking states.py's table), the
telemetry, the settings and the clock. Placement and spawn requests: spawning.py; a VM's
snapshots: snapshot_books.py. No module of pal/scheduler imports this one (an
import-linter contract, pyproject.toml): each takes only the parts it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pal.config import Settings
from pal.errors import Unavailable
from pal.scheduler.audit import ToolAudit
from pal.scheduler.background import Background, LeaderChores, LeaderState
from pal.scheduler.brokering import SecretBroker
from pal.scheduler.delete import Deleting
from pal.scheduler.deps import Chores, Deps, VmLocks
from pal.scheduler.drain import Draining
from pal.scheduler.egress_events import EgressEvents
from pal.scheduler.egress_secrets import EgressAndSecrets
from pal.scheduler.fork import Forking
from pal.scheduler.guest import GuestCalls
from pal.scheduler.idle import IdleSweeper
from pal.scheduler.kept import KeptSnapshots
from pal.scheduler.leader import Leadership, SingleProcessLeader
from pal.scheduler.lifetime import Lifetimes
from pal.scheduler.listing import Listing
from pal.scheduler.live import LiveOps
from pal.scheduler.liveview import LiveView
from pal.scheduler.nodes import NodePool
from pal.scheduler.pause_resume import PauseResume
from pal.scheduler.reads import Reads
from pal.scheduler.reconcile import Reconciler
from pal.scheduler.retention import Retention
from pal.scheduler.schedule import Scheduling
from pal.scheduler.snapshot_audit import SnapshotChecks
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.spawning import Spawner
from pal.scheduler.streams import StreamBudget
from pal.scheduler.telemetry import Telemetry
from pal.scheduler.transition import Transitioner
from pal.scheduler.views import ForkChild, ForkResult
from pal.scheduler.volumes import Volumes
from pal.scheduler.wake import Waker
from pal.store import Store
from pal.wire.handlers import NodeCalls

__all__ = ["ForkChild", "ForkResult", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        manager: NodeCalls | None = None,
        *,
        nodes: NodePool | None = None,
        clock: Callable[[], float] = time.time,
        leader: Leadership | None = None,
    ) -> None:
        """``manager``: an embedded node (`pal up`, tests); ``nodes``: the node pool of a
        control plane (remote nodes register through heartbeats)."""
        self.settings = settings
        self.store = store
        self.nodes = nodes or NodePool(settings, store)
        if manager is not None:
            self.nodes.add_local(manager)
        self.clock = clock
        self.leader: Leadership = leader or SingleProcessLeader()
        self.live_view = LiveView(store)
        self.transitions = Transitioner(store, on_change=self.live_view.apply)
        self.telemetry = Telemetry()
        self.locks = VmLocks()
        self.chores = Chores()
        self.brokering = SecretBroker(settings, store)
        self.lead = LeaderState()
        self.nodes.leading = lambda: self.lead.leading
        d = Deps(
            settings, store, self.nodes, self.transitions, self.locks, self.telemetry, clock, self.live_view
        )
        self.deps = d
        self.live = LiveOps(d, self.leader.is_leader)
        spawner = Spawner(d, self.brokering)
        books = SnapshotBooks(d)
        self.scheduling = Scheduling(d, spawner, self.brokering)
        self.pauses = PauseResume(d, spawner, books, self.live, self.chores.spawn)
        self.forking = Forking(d, spawner, books)
        self.kept = KeptSnapshots(d, books, self.forking, spawner)
        self.volumes = Volumes(d)
        self.deleting = Deleting(d, books, self.volumes)
        streams = StreamBudget(settings.tenant_max_streams, settings.vm_max_streams)
        # A guest request's VM, resolved once (wake.py); a WebSocket session's input frames
        # use it directly: each is then one node call.
        self.waker = Waker(d, self.live.resume, self.pauses.resume_locked, streams)
        self.guest = GuestCalls(d, self.waker)
        self.egress_secrets = EgressAndSecrets(d, self.brokering)
        self.draining = Draining(d, self.pauses, books, self.deleting)
        self.reads = Reads(d, spawner)
        self.audit = ToolAudit.of(d)
        self.listing = Listing(d)
        self.lifetimes = Lifetimes(d, self.pauses, self.deleting)
        self.egress_events = EgressEvents(store, self.nodes)
        self._leader_loops(d, books)

    def _leader_loops(self, d: Deps, books: SnapshotBooks) -> None:
        """What only the leader runs: reconciliation, the idle sweeper, the chores."""
        self.reconciler = Reconciler(
            d,
            record_offload=self.live.record_offload,
            leader_since=lambda: self.lead.since,
            spawn_chore=self.chores.spawn,
            books=books,
        )
        self.sweeper = IdleSweeper(d, self.pauses)
        self.retention = Retention(d)
        self.snapshot_checks = SnapshotChecks(d)
        chores = LeaderChores(
            reseal_secrets=self.egress_secrets.reseal_secrets,
            reseal_again=self.egress_secrets.reseal_again,
            record_egress_events=self.egress_events.record,
            purge_deleted_tenants=self.deleting.purge_deleted_tenants,
            end_lifetimes=self.lifetimes.sweep,
            retention=self.retention.sweep,
            audit_snapshots=self.snapshot_checks.audit,
            sweep_snapshots=self.snapshot_checks.sweep,
            sweep_again=self.snapshot_checks.again,
        )
        self.background = Background(
            d.settings,
            self.leader,
            self.nodes,
            d.clock,
            self.reconciler,
            self.sweeper,
            chores,
            self.lead,
            self.telemetry.loops,
        )

    # -- the scheduler itself ------------------------------------------------------------------

    async def start(self) -> None:
        """Take the lead if nobody holds it (then reconcile every VM), and start the loops:
        leadership renewal, and the leader's periodic chores. Unavailable if an embedded
        node does not answer its first heartbeat."""
        try:
            await self.nodes.register_local()
        except Exception as exc:
            raise Unavailable(f"the runtime manager did not answer its heartbeat: {exc}") from exc
        self.leader.keep()  # renews from the first token on: a long first takeover keeps the lease
        await self.background.lead_once()
        self.background.start()
        self.live.start()

    async def close(self) -> None:
        """Stop background tasks; VMs keep running."""
        await self.background.stop()
        await self.live.close()
        self.chores.cancel_all()
        await self.background.release()
        await self.nodes.aclose()
