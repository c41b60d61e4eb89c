"""Audit records that a client writes about its own use of a VM: the MCP server's tool
calls (pal/mcp), so the VM's event log says which agent tool touched it and when.

Bounded (docs/security.md, "Fair shares"): each VM keeps its newest
``PAL_AUDIT_EVENTS_PER_VM`` of them (a ring, trimmed in the write that adds one), and a
tenant may write ``PAL_AUDIT_RATE`` a second, in bursts of up to ``AUDIT_BURST_S`` worth
(a token bucket per tenant on this replica); past it 429 with ``Retry-After``. So one
client cannot grow the store without end, nor make others' writes wait behind its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pal.errors import TooManyRequests
from pal.scheduler.deps import Deps

MCP_TOOL_EVENT = "mcp_tool"
AUDIT_BURST_S = 10.0  # a burst of this many seconds' worth of the rate


@dataclass
class RateLimit:
    """A token bucket per key: ``rate`` a second, at most ``burst`` at once."""

    rate: float
    burst: float
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (tokens, at)

    def take(self, key: str, now: float) -> float | None:
        """One token for ``key`` at ``now``: None when taken, else the seconds until one is."""
        tokens, at = self.buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self.buckets[key] = (tokens - 1.0, now)
        return None


@dataclass(frozen=True)
class ToolAudit:
    d: Deps
    limit: RateLimit

    @classmethod
    def of(cls, d: Deps) -> ToolAudit:
        rate = d.settings.audit_rate
        return cls(d, RateLimit(rate, max(1.0, rate * AUDIT_BURST_S)))

    async def record_tool_call(self, tenant_id: str, vm_id: str, details: dict[str, object]) -> None:
        """An ``mcp_tool`` event on the tenant's VM (404 for another tenant's, as for a
        missing one; 429 past the tenant's rate). ``details`` are bounded by the caller (the
        API's model): the tool's name, the transport and the outcome, never the call's
        arguments. The VM keeps its newest PAL_AUDIT_EVENTS_PER_VM of them."""
        vm = self.d.own(tenant_id, vm_id)
        wait = self.limit.take(tenant_id, self.d.clock())
        if wait is not None:
            raise TooManyRequests(
                f"this tenant writes audit events faster than PAL_AUDIT_RATE={self.limit.rate:g} a second;"
                f" retry in {wait:.1f}s",
                retry_after_s=wait,
            )
        keep = self.d.settings.audit_events_per_vm
        self.d.store.add_ring_event(vm_id, vm.tenant_id, MCP_TOOL_EVENT, keep, details=dict(details))
