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
"""

from __future__ import annotations

import asyncio
import logging
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


class NodePool:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
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
        rec = self.store.get_node(node_id)
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

    def record(self, hb: NodeHeartbeat, *, url: str) -> NodeRecord:
        """Store a heartbeat (leader only: the write is fenced)."""
        now = utcnow()
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
            state=ACTIVE,
            epoch=hb.epoch,
            registered_at=now,
            last_seen_at=now,
        )
        return self.store.record_node(rec)

    async def register_local(self) -> None:
        """Before a placement: record embedded nodes that have not heartbeated yet, and
        refresh those whose record is a period old. An in-process node answers at once, and
        a background tick held up by slow work (a sweep on a loaded host) must not make it
        look silent to placement."""
        if self._unnamed or any(self._record_is_old(n) for n in self._local):
            await self.refresh_local()

    def _record_is_old(self, node_id: str) -> bool:
        rec = self.store.get_node(node_id)
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
            self.record(hb, url=LOCAL_URL)
            out.append(hb)
        for node_id, client in list(self._local.items()):
            if any(h.node_id == node_id for h in out):
                continue
            try:
                hb = await client.call(verbs.HEARTBEAT, Empty())
            except Exception as exc:
                log.warning("embedded node %s did not answer its heartbeat: %s", node_id, exc)
                continue
            self.record(hb, url=LOCAL_URL)
            out.append(hb)
        return out

    def nodes(self) -> list[NodeRecord]:
        return self.store.list_nodes()

    def state_of(self, node_id: str | None) -> str | None:
        if node_id is None:
            return ACTIVE if len(self._local) == 1 else None
        rec = self.store.get_node(node_id)
        return rec.state if rec else None

    def silent(self, node_id: str | None) -> bool:
        """A remote node whose last heartbeat is older than three periods: not asked for
        anything until it heartbeats again (node-loss detection decides about its VMs)."""
        if node_id is None or node_id in self._local:
            return False
        rec = self.store.get_node(node_id)
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
