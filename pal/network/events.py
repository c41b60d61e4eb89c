"""The gateway's events for the node to pull (``egress_denied``), one ring per VM.

One ring for the whole node would let a tenant whose VMs are refused often push another
tenant's events out before the node pulled them; each VM's ring holds only its own
(newest ``VM_RING`` kept; its refusals are also rate-limited where they are made). Events
are numbered across the node, so the node pulls everything after the last number it saw.
A VM's ring outlives the VM until the node has pulled past its last event, or until
``CLOSED_RINGS`` newer closed rings push it out (a node that never pulls).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict, deque
from typing import Any

VM_RING = 256  # events kept per VM between two pulls (the node pulls every few seconds)
CLOSED_RINGS = 1024  # rings of unregistered VMs kept until pulled


class Events:
    def __init__(self) -> None:
        self.rings: dict[str, deque[dict[str, Any]]] = {}
        self.closed: OrderedDict[str, None] = OrderedDict()  # unregistered VMs, oldest first
        self.seq = 0
        self.epoch = f"{os.getpid()}-{time.time_ns()}"  # a restarted gateway numbers anew

    def add(self, ev: dict[str, Any]) -> None:
        vm_id = str(ev.get("vmId"))
        self.seq += 1
        ring = self.rings.get(vm_id)
        if ring is None:
            ring = self.rings[vm_id] = deque(maxlen=VM_RING)
        ring.append({"seq": self.seq, "at": time.time(), **ev})

    def since(self, after: int) -> list[dict[str, Any]]:
        """Every kept event numbered after ``after``, in order; rings of VMs that are gone
        and whose events the node has now seen are dropped."""
        for vm_id in [v for v in self.closed if not self.rings.get(v) or self.rings[v][-1]["seq"] <= after]:
            self.closed.pop(vm_id)
            self.rings.pop(vm_id, None)
        out = [e for ring in self.rings.values() for e in ring if e["seq"] > after]
        out.sort(key=lambda e: int(e["seq"]))
        return out

    def vm_closed(self, vm_id: str) -> None:
        """The VM is unregistered: keep its ring until pulled, within ``CLOSED_RINGS``."""
        if vm_id not in self.rings:
            return
        self.closed[vm_id] = None
        self.closed.move_to_end(vm_id)
        while len(self.closed) > CLOSED_RINGS:
            old, _ = self.closed.popitem(last=False)
            self.rings.pop(old, None)

    def vm_registered(self, vm_id: str) -> None:
        """A new incarnation under the same id carries on with the same ring."""
        self.closed.pop(vm_id, None)
