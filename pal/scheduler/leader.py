"""Leadership: only the leader runs background loops (idle sweeper, periodic reconcile).

With SQLite there is one control-plane process, so it always leads. A PostgreSQL
implementation would hold ``pg_try_advisory_lock`` on a dedicated connection and report
``is_leader() == False`` on replicas that did not get it.
"""

from __future__ import annotations

from typing import Protocol


class Leadership(Protocol):
    async def acquire(self) -> bool:
        """Try to become leader; True if this process now leads."""
        ...

    async def is_leader(self) -> bool: ...

    async def release(self) -> None: ...


class SingleProcessLeader:
    """The only replica (SQLite store): always the leader."""

    async def acquire(self) -> bool:
        return True

    async def is_leader(self) -> bool:
        return True

    async def release(self) -> None:
        return None
