"""The nodes the scheduler places VMs on: their records (from heartbeats) and one RPC client
per node.

- An **embedded** node (`pal up`, or a test's fake) is added with :meth:`NodePool.add_local`
  and its heartbeat is *pulled* (the ``heartbeat`` verb) by the leader every
  ``PAL_NODE_HEARTBEAT_INTERVAL`` seconds.
- A **remote** node (`pal node`) *pushes* its heartbeat to ``POST /v1/nodes/heartbeat``; its
  client is an :class:`HttpNode` to the URL it reported, carrying its token
  (derived from ``PAL_CLUSTER_SECRET``; pal/manager/auth.py).

Both end in :meth:`NodePool.record` (a fenced store write: only the leader records).
Node states: ``active`` (placeable), ``draining`` (set by `pal node drain`: nothing new is
placed there), ``lost`` (silent for ``PAL_NODE_LOST_AFTER``; reconcile.py fails its VMs).

At a thousand nodes heartbeating every 5 s, the records are read far more often than they
change (placement, node loss, the loops' "is it silent?") and written 200 times a second,
so the pool keeps them in memory (docs/scale.md):

- reads come from that copy, refreshed from the store at most every :data:`REFRESH_S`
  while this replica does not lead (a follower's GET /v1/nodes); the leader, the only
  writer, keeps its own copy current and reads the store again only when it takes over
  (:meth:`reload`);
- a heartbeat updates the copy at once, and the leader writes the heartbeats that arrive
  together in one transaction (:meth:`record`, after :data:`BATCH_S`): each waits for its
  batch's commit before it is acknowledged; one that changes nothing but the time is
  written at most every :data:`REWRITE_PERIODS` periods;
- each node's latest report is kept (:meth:`report`): the reconciler compares it with what
  the leader expects there instead of asking the node again (reconcile.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from pal.config import Settings
from pal.errors import Unavailable
from pal.scheduler.node_client import HttpNode
from pal.store import NodeRecord, Store, utcnow
from pal.wire import verbs
from pal.wire.auth import node_token
from pal.wire.handlers import NodeCalls
from pal.wire.models import Empty, NodeHeartbeat

log = logging.getLogger(__name__)

ACTIVE, DRAINING, LOST = "active", "draining", "lost"
LOCAL_URL = "local"  # the url recorded for an embedded node
REFRESH_S = 1.0  # a replica that does not lead reads the nodes again after this long
BATCH_S = 0.02  # heartbeats arriving within this long are written in one transaction
REWRITE_PERIODS = 2  # a heartbeat that changes nothing is written at most every this many periods


class NodePool:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        # Whether this replica leads (the Scheduler sets it): the leader's copy is current.
        self.leading: Callable[[], bool] = lambda: False
        self._records: dict[str, NodeRecord] | None = None
        self._read_at = 0.0  # monotonic, of the last read from the store
        self._pending: dict[str, NodeRecord] = {}  # recorded, not yet written
        self._flush: asyncio.Task[None] | None = None
        self._reports: dict[str, tuple[float, NodeHeartbeat]] = {}  # node id -> (monotonic, its report)
        self._written: dict[str, float] = {}  # node id -> monotonic: its record last written
        self._local: dict[str, NodeCalls] = {}
        self._unnamed: list[NodeCalls] = []  # embedded clients whose id is not known yet
        self._remote: dict[str, tuple[str, HttpNode]] = {}  # node id -> (url, client)
        self._injected: dict[str, NodeCalls] = {}

    # -- clients ----------------------------------------------------------------------------

    def add_local(self, client: NodeCalls, node_id: str | None = None) -> None:
        """An embedded node; its id comes from its first heartbeat unless given."""
        if node_id is None:
            self._unnamed.append(client)
        else:
            self._local[node_id] = client

    def use_client(self, node_id: str, client: NodeCalls) -> None:
        """Reach the (remote) node ``node_id`` through ``client`` instead of an HTTP client
        built from its record: for nodes living in this process (tests, benchmarks)."""
        self._injected[node_id] = client

    def local_ids(self) -> list[str]:
        return sorted(self._local)

    def reachable_ids(self) -> list[str]:
        """Nodes worth asking now: the embedded ones and every known node neither lost nor
        silent (fan-out chores like deleting a VM's snapshots everywhere)."""
        ids = set(self._local) | set(self._injected)
        for rec in self.nodes():
            if rec.state != LOST and not self.silent(rec.node_id):
                ids.add(rec.node_id)
        return sorted(ids)

    def local_clients(self) -> list[NodeCalls]:
        """The embedded nodes' clients (`pal up`), named or not yet."""
        return [*self._local.values(), *self._unnamed]

    def is_local(self, node_id: str | None) -> bool:
        return node_id is not None and node_id in self._local

    def client(self, node_id: str | None) -> NodeCalls:
        """The RPC client of ``node_id`` (Unavailable if the node is unknown). A VM row
        without a node (written before nodes existed) belongs to the only embedded node."""
        if node_id is None:
            if len(self._local) == 1:
                return next(iter(self._local.values()))
            raise Unavailable("VM has no node")
        if node_id in self._local:
            return self._local[node_id]
        if node_id in self._injected:
            return self._injected[node_id]
        rec = self.get(node_id)
        if rec is None or rec.url in ("", LOCAL_URL):
            raise Unavailable(f"node {node_id} is not known to this control plane")
        cached = self._remote.get(node_id)
        if cached is not None and cached[0] == rec.url:
            return cached[1]
        if not self.settings.cluster_secret:
            raise Unavailable("PAL_CLUSTER_SECRET is not set: cannot authenticate to remote nodes")
        client = HttpNode(
            url=rec.url,
            token=node_token(self.settings.cluster_secret, node_id),
            max_streams=self.settings.node_max_streams,
        )
        if cached is not None:
            asyncio.get_running_loop().create_task(cached[1].aclose())
        self._remote[node_id] = (rec.url, client)
        return client

    async def aclose(self) -> None:
        for _, c in self._remote.values():
            await c.aclose()
        self._remote.clear()

    # -- records ----------------------------------------------------------------------------

    def _copy(self) -> dict[str, NodeRecord]:
        stale = self._records is None or (not self.leading() and time.monotonic() - self._read_at > REFRESH_S)
        if stale:
            self.reload()
        assert self._records is not None
        return self._records

    def reload(self) -> None:
        """Read every node from the store (the leader on taking over; a follower every
        REFRESH_S); what is recorded but not written yet stays."""
        records = {r.node_id: r for r in self.store.list_nodes()}
        records.update(self._pending)
        self._records, self._read_at = records, time.monotonic()

    def get(self, node_id: str) -> NodeRecord | None:
        return self._copy().get(node_id)

    async def record(self, hb: NodeHeartbeat, *, url: str) -> NodeRecord:
        """Store a heartbeat (leader only: the write is fenced), with the others that come
        within BATCH_S; the node's record as it now stands. A node marked lost that
        heartbeats again is active again (the caller has stopped what it must not run); an
        operator's ``draining`` stays."""
        now = utcnow()
        old = self.get(hb.node_id)
        rec = NodeRecord(
            node_id=hb.node_id,
            url=url,
            region=hb.region,
            labels=dict(hb.labels),
            capacity=hb.capacity.model_dump(by_alias=True),
            templates=[t.model_dump(by_alias=True) for t in hb.templates],
            images=[i.model_dump(by_alias=True) for i in hb.images],
            healthy=hb.healthy,
            health=hb.health,
            vm_count=sum(1 for v in hb.vms if v.alive),
            state=DRAINING if old is not None and old.state == DRAINING else ACTIVE,
            epoch=hb.epoch,
            registered_at=old.registered_at if old is not None else now,
            last_seen_at=now,
        )
        self._reports[hb.node_id] = (time.monotonic(), hb)
        self._copy()[hb.node_id] = rec
        if self._unchanged(old, rec):
            return rec  # in memory now; in the store at its next write (REWRITE_PERIODS)
        self._pending[hb.node_id] = rec
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_task(self._write_batch())
        await asyncio.shield(self._flush)
        self._written[hb.node_id] = time.monotonic()
        return self.get(hb.node_id) or rec

    def _unchanged(self, old: NodeRecord | None, rec: NodeRecord) -> bool:
        """A heartbeat that says what the stored record says (but the time and the VM
        count), while the store's copy is fresh enough: the leader, the only reader of
        ``last_seen_at`` that decides anything, has it in memory; the others read it at
        most REWRITE_PERIODS old (a node writes a few hundred bytes of JSON every period
        otherwise: 200 writes a second at 1,000 nodes)."""
        written = self._written.get(rec.node_id)
        if old is None or written is None or not self.leading():
            return False
        if time.monotonic() - written > REWRITE_PERIODS * self.settings.node_heartbeat_interval_s:
            return False
        same = dataclasses.replace(old, last_seen_at=rec.last_seen_at, vm_count=rec.vm_count)
        return same == rec

    async def _write_batch(self) -> None:
        await asyncio.sleep(BATCH_S)
        batch, self._pending, self._flush = self._pending, {}, None
        try:  # on a worker thread: its commit waits for the disk, the loop goes on
            stored = await asyncio.to_thread(self.store.record_nodes, list(batch.values()))
        except Exception:
            # Not written (a deposed leader's fenced write): the store's copy stands.
            if self._records is not None:
                for node_id in batch:
                    self._records.pop(node_id, None)
            self._read_at = 0.0
            raise
        if self._records is not None:
            self._records.update({r.node_id: r for r in stored})

    def report(self, node_id: str | None, max_age_s: float) -> NodeHeartbeat | None:
        """The node's latest report if it came within ``max_age_s``, else None."""
        got = self._reports.get(node_id or "")
        if got is None or time.monotonic() - got[0] > max_age_s:
            return None
        return got[1]

    def set_state(self, node_id: str, state: str, *, expect: str | None = None) -> bool:
        """Set a node's state (only if it is ``expect``, when given); True if it changed."""
        changed = self.store.set_node_state(node_id, state, expect=expect)
        rec = self.get(node_id)
        if changed and rec is not None and self._records is not None:
            self._records[node_id] = dataclasses.replace(rec, state=state)
        return changed

    async def register_local(self) -> None:
        """Before a placement: record embedded nodes that have not heartbeated yet, and
        refresh those whose record is a period old. An in-process node answers at once, and
        a background tick held up by slow work (a sweep on a loaded host) must not make it
        look silent to placement."""
        if self._unnamed or any(self._record_is_old(n) for n in self._local):
            await self.refresh_local()

    def _record_is_old(self, node_id: str) -> bool:
        rec = self.get(node_id)
        return (
            rec is None
            or (utcnow() - rec.last_seen_at).total_seconds() > self.settings.node_heartbeat_interval_s
        )

    async def refresh_local(self) -> list[NodeHeartbeat]:
        """Pull and record the embedded nodes' heartbeats; returns them. A node that does
        not answer is skipped (its record ages; reconcile.py decides when it is lost)."""
        out = []
        for client in list(self._unnamed):
            hb = await client.call(verbs.HEARTBEAT, Empty())
            self._unnamed.remove(client)
            self._local[hb.node_id] = client
            await self.record(hb, url=LOCAL_URL)
            out.append(hb)
        for node_id, client in list(self._local.items()):
            if any(h.node_id == node_id for h in out):
                continue
            try:
                hb = await client.call(verbs.HEARTBEAT, Empty())
            except Exception as exc:
                log.warning("embedded node %s did not answer its heartbeat: %s", node_id, exc)
                continue
            await self.record(hb, url=LOCAL_URL)
            out.append(hb)
        return out

    def nodes(self) -> list[NodeRecord]:
        return sorted(self._copy().values(), key=lambda r: r.node_id)

    def state_of(self, node_id: str | None) -> str | None:
        if node_id is None:
            return ACTIVE if len(self._local) == 1 else None
        rec = self.get(node_id)
        return rec.state if rec else None

    def silent(self, node_id: str | None) -> bool:
        """A remote node whose last heartbeat is older than three periods: not asked for
        anything until it heartbeats again (node-loss detection decides about its VMs)."""
        if node_id is None or node_id in self._local:
            return False
        rec = self.get(node_id)
        if rec is None:
            return False
        return (utcnow() - rec.last_seen_at).total_seconds() > 3 * self.settings.node_heartbeat_interval_s

    def view(self, rec: NodeRecord, load: Any = None) -> dict[str, Any]:
        """A node as `pal node ls` and GET /v1/nodes show it (camelCase)."""
        age = (utcnow() - rec.last_seen_at).total_seconds()
        out: dict[str, Any] = {
            "nodeId": rec.node_id,
            "state": rec.state,
            "healthy": rec.healthy,
            "health": rec.health,
            "url": rec.url,
            "region": rec.region,
            "labels": rec.labels,
            "capacity": rec.capacity,
            "vmsLive": rec.vm_count,
            "warmTemplates": len(rec.templates),
            "images": [i.get("name") for i in rec.images],
            "lastSeenSecsAgo": round(age, 1),
            "registeredAt": rec.registered_at.isoformat(),
        }
        if load is not None:
            out["vmsPlaced"] = load.vms
            out["memoryMibPlaced"] = load.memory_mib
        return out
