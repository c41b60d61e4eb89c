"""Who may hold how many long-lived calls at once on this control plane: per tenant and per
VM (docs/security.md, "Fair shares").

A long-lived call (an exec, buffered or streamed; a process's output stream or WebSocket
attach; a long poll; a code cell or a kernel's start; a request to or a tunnel into a VM's
port) holds a connection to the VM's node, and the guest's attention, for as long as it
lasts. Each node has its own ceiling (pal/scheduler/node_client.py, ``StreamSlots``); under
it, a tenant may hold at most ``PAL_TENANT_MAX_STREAMS`` of them and each VM at most
``PAL_VM_MAX_STREAMS``, so one tenant can never take what the others need. Past a cap a new
call is refused at once with 429 ``RESOURCE_EXHAUSTED``, before anything runs; nothing
waits for a free slot. Each replica counts its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pal.errors import TooManyRequests


@dataclass
class StreamBudget:
    per_tenant: int
    per_vm: int
    by_tenant: dict[str, int] = field(default_factory=dict)
    by_vm: dict[str, int] = field(default_factory=dict)

    def take(self, tenant_id: str, vm_id: str) -> Callable[[], None]:
        """One slot for a call of ``tenant_id`` on ``vm_id`` (429 past a cap); the function
        that gives it back (idempotent)."""
        held_t, held_v = self.by_tenant.get(tenant_id, 0), self.by_vm.get(vm_id, 0)
        if held_t >= self.per_tenant:
            raise TooManyRequests(
                f"this tenant already holds {held_t} long-lived calls (execs, streams, attaches, long "
                f"polls, cells, port connections), its budget (PAL_TENANT_MAX_STREAMS={self.per_tenant}):"
                " retry when some have ended"
            )
        if held_v >= self.per_vm:
            raise TooManyRequests(
                f"VM {vm_id} already has {held_v} long-lived calls open, its budget "
                f"(PAL_VM_MAX_STREAMS={self.per_vm}): retry when some have ended"
            )
        self.by_tenant[tenant_id] = held_t + 1
        self.by_vm[vm_id] = held_v + 1
        given = False

        def give() -> None:
            nonlocal given
            if not given:
                given = True
                _drop(self.by_tenant, tenant_id)
                _drop(self.by_vm, vm_id)

        return give

    @contextlib.contextmanager
    def lease(self, tenant_id: str, vm_id: str) -> Iterator[None]:
        give = self.take(tenant_id, vm_id)
        try:
            yield
        finally:
            give()


def _drop(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 1) - 1
    if n <= 0:
        counts.pop(key, None)
    else:
        counts[key] = n
