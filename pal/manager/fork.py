"""Fork memory: a fork child maps its source snapshot's memory file privately
(copy-on-write), shared with its siblings through the page cache. The file lives while a
child maps it; this module counts the children per snapshot and drops the file after the
last one (docs/lifecycle.md, "Fork")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from pal.snapshots.layout import SnapshotRef
from pal.snapshots.store import SnapshotStore
from pal.vmm.jail import Jail

log = logging.getLogger(__name__)


class ForkMemory:
    def __init__(self, store: SnapshotStore, jail: Jail) -> None:
        self.store = store
        self.jail = jail
        self.users: dict[str, int] = {}  # snapshot id -> children mapping (or about to map) it

    def count(self, snapshot_id: str) -> None:
        self.users[snapshot_id] = self.users.get(snapshot_id, 0) + 1

    async def map(self, ref: SnapshotRef, slot: str) -> tuple[Path, tuple[int, ...]]:
        """One more child of ``ref``: its fork memory file (made on first use) and the
        groups that may read it. Counted first, so a failure here is undone by
        :meth:`unmap` like any other."""
        self.count(ref.snapshot_id)
        path = await asyncio.to_thread(self.store.fork_mem, ref)
        # Mapped copy-on-write by this VM and its siblings: their group's alone.
        return path, self.jail.share(path, slot)

    async def unmap(self, snapshot_id: str) -> None:
        """One fork child less maps the snapshot's fork memory file; drop it at zero."""
        n = self.users.get(snapshot_id, 0) - 1
        if n > 0:
            self.users[snapshot_id] = n
            return
        self.users.pop(snapshot_id, None)
        try:
            await asyncio.to_thread(self.store.drop_fork_mem, snapshot_id)
        except OSError as exc:
            log.warning("could not remove the fork memory file of %s: %s", snapshot_id, exc)

    async def adopted(self, mapped: Iterable[str]) -> None:
        """After adoption: count the adopted children, remove the files none maps."""
        for snapshot_id in mapped:
            self.count(snapshot_id)
        pruned = await asyncio.to_thread(self.store.prune_fork_mem, set(self.users))
        if pruned:
            log.info("removed fork memory files no live VM maps: %s", pruned)
