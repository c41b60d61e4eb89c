"""Retention: what the store keeps of the past, swept by the leader a page at a time (each
sweep reads and writes at most :data:`PAGE` rows of each kind, through the index of what
is due, so its cost follows what ended, never what the fleet holds: docs/scale.md).

- A terminated VM leaves its tenant's list (and the metadata filter) an hour after it
  ended (:data:`TERMINATED_VISIBLE`); its row and events stay (GET still answers it).
- Events (status changes and audits) older than ``PAL_EVENT_RETENTION_DAYS`` are deleted.
  The store's ``prune_events`` is generic (by age, optionally by kind): a bound on one
  VM's audit events (a ring, a rate) belongs with the audit's writer and uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from pal.scheduler.deps import Deps
from pal.store import utcnow
from pal.store.due import unlist_terminated

# A terminated VM stays in its tenant's list this long, then leaves it (the row stays).
TERMINATED_VISIBLE = timedelta(hours=1)
PAGE = 1000  # rows of each kind a sweep takes at most (the rest: the next sweep's)


@dataclass(frozen=True)
class Retention:
    d: Deps

    async def sweep(self) -> dict[str, int]:
        """One tick (leader only): what it took out of the list and deleted."""
        now = utcnow()
        unlisted = unlist_terminated(self.d.store, now - TERMINATED_VISIBLE, PAGE)
        days = self.d.settings.event_retention_days
        pruned = self.d.store.prune_events(now - timedelta(days=days), PAGE)
        return {"unlisted": unlisted, "events": pruned}
