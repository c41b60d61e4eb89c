"""A live VM's network with the egress gateway: its policy and brokered secrets changed
while it runs, its counters and events, and the gateway's own (re)start on this node."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from pal.manager.live import LiveControl
from pal.manager.notices import NoticeBoard
from pal.manager.vm import VmRegistry
from pal.manager.vmnet import Brokered, VmNetworking, limits_json, wait_rule
from pal.manager.waits import WaitWatcher
from pal.wire.models import BrokeredSet, EgressEvents, EgressSet, EgressSetResult

log = logging.getLogger(__name__)


class Egress:
    def __init__(self, registry: VmRegistry, net: VmNetworking, notices: NoticeBoard) -> None:
        self.registry = registry
        self.net = net
        self.notices = notices
        net.gateway.on_restart = self.gateway_restarted

    async def set_egress(self, vm_id: str, req: EgressSet) -> EgressSetResult:
        """Apply a new policy to a live VM: new connections at once, refused open ones reset."""
        lv = self.registry.live(vm_id)
        limits = limits_json(req.egress_mbps, req.max_connections)
        closed = await self.net.set_policy(vm_id, req.egress, limits)
        lv.egress, lv.net_limits = req.egress, limits
        self.registry.write_state(lv)
        return EgressSetResult(closed=closed)

    async def set_brokered(self, vm_id: str, req: BrokeredSet) -> None:
        """New values for a live VM's brokered secrets: the gateway uses them from the next
        request (open connections included); the guest is not touched."""
        lv = self.registry.live(vm_id)
        rules = [r.model_dump(mode="json") for r in req.brokered]
        await self.net.set_brokered(vm_id, rules)
        lv.brokered = Brokered(rules, lv.brokered.ca)
        self.registry.write_state(lv)

    async def counters(self, vm_id: str) -> dict[str, Any] | None:
        self.registry.live(vm_id)
        return await self.net.counters(vm_id)

    async def events(self, after: int, epoch: str) -> EgressEvents:
        return EgressEvents.model_validate(await self.net.events(after, epoch))

    # ------------------------------------------------------------------ the gateway
    async def start(self, waits: WaitWatcher) -> None:
        """Start (or adopt) the egress gateway and watch its events; before adoption."""
        await self.net.gateway.start()
        self.net.gateway.watch(waits.on_gateway_event)

    async def settle(self, parked: Iterable[str], live: LiveControl, waits: WaitWatcher) -> None:
        """After adoption: the gateway and the namespaces hold exactly the live (and
        parked) VMs; the adopted live pauses and waits are watched again (what came
        meanwhile is posted)."""
        await self.net.sync(set(self.registry.vms) | set(parked), self.registry.slots.slots())
        await live.rearm_all()
        await waits.start()

    async def gateway_restarted(self) -> None:
        """The gateway died and was restarted empty: give it every live VM again. The
        connections it held are gone, so a wait-paused guest is woken to see that."""
        for lv in list(self.registry.vms.values()):
            try:
                await self.net.reregister(
                    lv.vm_id, lv.slot, lv.egress, lv.net_limits, lv.brokered, wait_rule(lv.wait)
                )
            except Exception as exc:
                log.error("VM %s lost its network with the gateway: %s", lv.vm_id, exc)
            if lv.live is not None:
                with contextlib.suppress(Exception):
                    await self.net.hold(lv.vm_id)
                if lv.live.by == "wait":
                    self.notices.post(lv.vm_id, "wake", reason="gateway restarted")
