"""The nodes' egress events (egress_denied, and the secret_reflected audits of brokered
connections), pulled into the VMs' event logs by the leader's loop."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from pal.scheduler import nodes as nodes_mod
from pal.scheduler.nodes import NodePool
from pal.store import Store
from pal.wire import verbs
from pal.wire.models import EventsAfter

log = logging.getLogger(__name__)
# The nodes are asked at once, this many at a time, each for at most this long: a sweep's
# pull costs about one node's answer, not one per node (docs/scale.md).
ASK_AT_ONCE = 32
ASK_TIMEOUT_S = 5.0
# Each remote node is asked at most this often (a node keeps its newest 2,000 events): at
# 1,000 nodes, a sweep asks a third of them instead of all (100 requests a second otherwise).
PULL_EVERY_S = 30.0


def egress_reason(
    name: str | None, address: str | None, port: int | None, rule: str, more: int | None
) -> str:
    """An egress_denied event in words: `refused pypi.org (151.101.0.223) port 443: not in the
    allow list`."""
    dest = name or address or "?"
    if name and address:
        dest = f"{name} ({address})"
    text = f"refused {dest}" + (f" port {port}" if port else "") + f": {rule}"
    if more:
        text += f" ({more} earlier refusals not listed)"
    return text


class EgressEvents:
    def __init__(self, store: Store, nodes: NodePool) -> None:
        self.store = store
        self.nodes = nodes
        self._seq: dict[str, tuple[int, str]] = {}  # node id -> (seq, epoch) pulled so far
        self._pulled: dict[str, float] = {}  # node id -> monotonic: when it was last asked

    async def record(self) -> int:
        """Pull the nodes' new egress_denied events into the VMs' event logs (leader loop):
        those not asked for PULL_EVERY_S. Bounded: a node keeps the newest few thousand; a
        gap is not an error."""
        gate = asyncio.Semaphore(ASK_AT_ONCE)

        async def one(node_id: str) -> int:
            async with gate:
                try:
                    return await asyncio.wait_for(self._record_of(node_id), ASK_TIMEOUT_S)
                except Exception as exc:
                    log.warning("egress events of node %s unavailable: %s", node_id, exc)
                    return 0

        now = time.monotonic()
        asked = [
            rec.node_id
            for rec in self.nodes.nodes()
            if rec.state != nodes_mod.LOST
            and not self.nodes.silent(rec.node_id)
            and (
                self.nodes.is_local(rec.node_id) or now - self._pulled.get(rec.node_id, -1e9) >= PULL_EVERY_S
            )
        ]
        self._pulled.update({n: now for n in asked})
        return sum(await asyncio.gather(*(one(n) for n in asked)))

    async def _record_of(self, node_id: str) -> int:
        seq, epoch = self._seq.get(node_id, (0, ""))
        got = await self.nodes.client(node_id).call(verbs.EGRESS_EVENTS, EventsAfter(after=seq, epoch=epoch))
        self._seq[node_id] = (got.seq, got.epoch)
        n = 0
        tenants: dict[str, str | None] = {}
        for ev in got.events:
            if ev.vm_id not in tenants:
                row = self.store.get_vm(ev.vm_id)
                tenants[ev.vm_id] = row.tenant_id if row else None
            tenant = tenants[ev.vm_id]
            if tenant is None:
                continue  # a template VM, or a VM deleted since
            details = ev.model_dump(by_alias=True, exclude={"seq", "at", "vm_id", "kind"}, exclude_none=True)
            self.store.add_event(
                ev.vm_id,
                tenant,
                ev.kind,
                # secret_reflected (a brokered connection's audit) says what happened in its rule
                reason=egress_reason(ev.name, ev.address, ev.port, ev.rule, ev.suppressed)
                if ev.kind == "egress_denied"
                else f"{ev.name}: {ev.rule}",
                details=details,
                at=datetime.fromtimestamp(ev.at, UTC),
            )
            n += 1
        return n
