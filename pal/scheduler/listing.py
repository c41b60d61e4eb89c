"""The paged reads of the API (pal/api/pagination.py decodes the cursors): a tenant's VMs,
filtered by metadata, and a VM's events, each one page at a time from the store. Like
reads.py, nothing here changes state."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pal.scheduler.deps import Deps
from pal.store import EventRecord, VmRecord
from pal.store.paging import event_page, latest_events, vm_page


@dataclass(frozen=True)
class Listing:
    d: Deps

    async def vms(
        self, tenant_id: str, *, after: tuple[datetime, str] | None, limit: int, metadata: dict[str, str]
    ) -> list[VmRecord]:
        """Up to ``limit`` listed VMs (terminated ones an hour at most: retention.py)."""
        return vm_page(self.d.store, tenant_id, after=after, limit=limit, metadata=metadata)

    async def events(self, tenant_id: str, vm_id: str, *, after: int | None, limit: int) -> list[EventRecord]:
        self.d.own(tenant_id, vm_id)
        return event_page(self.d.store, vm_id, after=after, limit=limit)

    async def latest_events(
        self, tenant_id: str, vm_id: str, *, before: int | None = None, limit: int = 50
    ) -> list[EventRecord]:
        """Newest first, a page at a time (the dashboard's timeline)."""
        self.d.own(tenant_id, vm_id)
        return latest_events(self.d.store, vm_id, before=before, limit=limit)
