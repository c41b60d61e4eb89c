"""Ports: byte streams to servers listening in a guest, through its network namespace
(ports.py routes them), and what their traffic means for the VM's idleness and waits."""

from __future__ import annotations

from pal.manager.notices import NoticeBoard
from pal.manager.ports import GuestConnection, PortRoutes
from pal.manager.vm import VmRegistry
from pal.manager.vmnet import VmNetworking


class GuestPorts:
    def __init__(
        self, registry: VmRegistry, routes: PortRoutes, net: VmNetworking, notices: NoticeBoard
    ) -> None:
        self.registry = registry
        self.routes = routes
        self.net = net
        self.notices = notices

    async def open_port(self, vm_id: str, port: int) -> GuestConnection:
        """A byte stream to the server listening on ``port`` in the guest (0.0.0.0 or
        127.0.0.1). Prerequisites: the VM is live here (else 409). Failure: 400 for a port
        outside 1-65535, 502 when nothing listens there or the guest does not answer, 409
        LIVE_PAUSED while its vCPUs are stopped (the scheduler wakes it and asks again)."""
        lv = self.registry.running(vm_id)
        conn = await self.routes.open(vm_id, self.net.ns_name(lv.slot), port)
        self.port_traffic(vm_id)
        return conn

    def port_traffic(self, vm_id: str) -> None:
        """Bytes moved on one of the VM's ports: host-observed activity (idle suspend). Bytes
        for a wait-paused guest (a stream opened before the pause) wake it: a port request
        is a wake event (docs/live-pause.md)."""
        lv = self.registry.vms.get(vm_id)
        if lv is not None:
            lv.touch()
            if lv.live is not None and lv.live.by == "wait" and not lv.live.port_woken:
                lv.live.port_woken = True
                self.notices.post(vm_id, "wake", reason="port traffic")
