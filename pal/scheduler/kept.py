"""Kept snapshots: a snapshot of a VM that its tenant keeps, by a name or by its id, and
starts new VMs from (docs/lifecycle.md, "Kept snapshots"; E2B's named snapshots).

- **Taking one** captures the VM as a fork does (a running or live-paused VM keeps running,
  or stays paused; a snapshot-paused one keeps its pause snapshot under the new name) and
  records a ``kept_snapshots`` row. The files stay where the VM's snapshots are: its node,
  and S3 where S3 is configured (the mirror uploads it once sealed; a start on another node
  asks the node that took it to upload it first, as a fork does).
- **What keeps it**: its VM's retention (newest 3, 7 days) never deletes it (it is
  protected in every snapshot request of its VM), its VM's delete and the leader's sweep
  leave it; the tenant's delete of it, or the removal of the tenant, lets it go.
- **What it costs**: its bytes stay on its VM's row (``snapshot_bytes``, measured on its
  node after the VM's delete), so it counts against the tenant's snapshot limit as the
  VM's snapshots do, and a take is refused (402) when a snapshot of the VM's RAM would not fit.
- **Starting from it** is a fork of its VM from that snapshot (fork.py ``start_from``),
  whatever the VM's state now: fresh identity, its own id, the captured memory, disk and
  processes.
- **Names** are the tenant's: unique among its kept snapshots (keeping another snapshot
  under a name moves the name to it, as E2B assigns a new build to the existing template);
  a name that is one of the tenant's images, or that looks like a snapshot id, is 409.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pal.errors import Conflict, InvalidRequest, NotFound, PalError
from pal.scheduler import quotas, states
from pal.scheduler.deps import Deps, new_snapshot_id
from pal.scheduler.fork import Forking
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.spawning import Spawner
from pal.scheduler.states import FINAL, Action, has_live_qemu
from pal.scheduler.views import ForkResult
from pal.store import VmRecord, utcnow
from pal.store import kept as kept_rows
from pal.store.kept import KeptSnapshot
from pal.wire import verbs
from pal.wire.models import SnapshotAt

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
log = logging.getLogger(__name__)
ID_PREFIX = "snap-"  # new_snapshot_id's: no name takes it


def check_name(name: str) -> None:
    if not NAME.match(name):
        raise InvalidRequest(
            f"snapshot name {name[:120]!r}: 1-100 letters, digits, '.', '_' or '-',"
            " starting with a letter or digit"
        )
    if name.startswith(ID_PREFIX):
        raise Conflict(f"snapshot name {name!r}: names starting with {ID_PREFIX!r} are snapshot ids")


@dataclass(frozen=True)
class KeptSnapshots:
    d: Deps
    books: SnapshotBooks
    forking: Forking
    spawner: Spawner

    async def keep(self, tenant_id: str, vm_id: str, name: str | None = None) -> KeptSnapshot:
        """Keep a snapshot of ``vm_id`` (under ``name``).

        Prerequisites: the tenant's VM (404); FORK_FROM allowed (running or paused: 409
        else, or for a snapshot-paused VM without a snapshot); a valid name (400) that is
        not one of the tenant's images (409); room for a snapshot of its RAM in the
        tenant's snapshot limit (402, nothing taken). Success: the kept row, the VM as it
        was (a running one ran on after a ~30 ms capture). Failure of the capture: 500
        with its reason, nothing kept; the VM failed only if its QEMU died."""
        d = self.d
        if name is not None:
            check_name(name)
            if name in {i.name for i in await self.spawner.visible_images(tenant_id)}:
                raise Conflict(f"snapshot name {name!r} is taken by an image (a template) of the tenant's")
        d.own(tenant_id, vm_id)
        async with d.locks.op_lock(vm_id):
            src = d.reload(vm_id)
            states.check(vm_id, src.state, Action.FORK_FROM, src.marker)
            if has_live_qemu(src.state, src.marker):
                with d.store.write() as tx:
                    quotas.check_snapshot_bytes_in(tx, tenant_id, self.books.estimate(src))
                snap_id = new_snapshot_id()
                taken = await self.forking.capture(src, snap_id)
                if isinstance(taken, str):
                    raise PalError(taken)
                await self.books.record_bytes(vm_id, taken)
            elif src.snapshot_id:
                snap_id = src.snapshot_id
            else:
                raise Conflict(f"paused VM {vm_id} has no snapshot to keep")
            rec = KeptSnapshot(
                snapshot_id=snap_id,
                tenant_id=tenant_id,
                name=name,
                source_vm_id=vm_id,
                agent_version_id=src.agent_version_id or "",
                node_id=src.node_id,
                created_at=utcnow(),
            )
            if kept_rows.get(d.store, tenant_id, snap_id) is not None:
                raise Conflict(f"snapshot {snap_id} is kept already")
            kept_rows.add(d.store, rec)
        return rec

    def get(self, tenant_id: str, id_or_name: str) -> KeptSnapshot:
        """The tenant's kept snapshot of that id or name (E2B's ``name:tag`` too; 404 else,
        another tenant's included)."""
        found = kept_rows.get(self.d.store, tenant_id, id_or_name)
        if found is None and id_or_name.endswith(":default"):
            found = kept_rows.get(self.d.store, tenant_id, id_or_name.removesuffix(":default"))
        if found is None:
            raise NotFound(f"snapshot {id_or_name} not found")
        return found

    def list(
        self,
        tenant_id: str,
        *,
        vm_id: str | None = None,
        name: str | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int = 100,
    ) -> list[KeptSnapshot]:
        """The tenant's kept snapshots, oldest first, after the key ``after``: of one VM,
        of one name or id."""
        if name is not None:
            try:
                one = [self.get(tenant_id, name)]
            except NotFound:
                return []
            return [
                k
                for k in one
                if (vm_id is None or k.source_vm_id == vm_id)
                and (after is None or (k.created_at, k.snapshot_id) > after)
            ]
        return kept_rows.page(self.d.store, tenant_id, source_vm_id=vm_id, after=after, limit=limit)

    async def start(
        self,
        tenant_id: str,
        id_or_name: str,
        count: int = 1,
        metadata: Mapping[str, str] | None = None,
        secrets: Mapping[str, Any] | None = None,
    ) -> ForkResult:
        """``count`` new VMs from the tenant's kept snapshot (fork.py ``start_from``), tagged
        ``metadata`` instead of the source's tags when given, ``secrets`` over the source's."""
        found = self.get(tenant_id, id_or_name)
        return await self.forking.start_from(tenant_id, found, count, metadata, secrets)

    async def delete(self, tenant_id: str, id_or_name: str) -> KeptSnapshot:
        """Let the tenant's kept snapshot go (404: none of that id or name). Its files go
        now unless its VM still needs them (its pause snapshot, one a live child maps:
        then the VM's own rules delete them later); its VM's books are measured again. The
        VMs started from it are not touched. Best effort on the node: what a failure leaves
        is the sweep's (snapshot_audit.py)."""
        d = self.d
        found = self.get(tenant_id, id_or_name)
        gone = kept_rows.remove(d.store, tenant_id, found.snapshot_id)
        if gone is None:
            raise NotFound(f"snapshot {id_or_name} not found")
        src = d.store.get_vm(gone.source_vm_id)
        if src is None or gone.node_id is None or not self._unused(src, gone.snapshot_id):
            return gone
        try:
            at = SnapshotAt(
                agent_version_id=gone.agent_version_id, vm_id=gone.source_vm_id, snapshot_id=gone.snapshot_id
            )
            await d.nodes.client(gone.node_id).call(verbs.DELETE_SNAPSHOT, at)
        except Exception as exc:
            log.warning("could not delete kept snapshot %s of %s: %s", gone.snapshot_id, src.vm_id, exc)
        await self.books.refresh_bytes(src.vm_id)
        return gone

    def _unused(self, src: VmRecord, snapshot_id: str) -> bool:
        """No VM needs this snapshot of ``src`` any more: ``src`` is running or gone (a
        paused one's snapshots are left to its retention, which no longer protects this
        one: a delete would discard its parked QEMU), and no child that may still run maps
        it."""
        if src.state == "paused" or (src.state not in FINAL and src.snapshot_id == snapshot_id):
            return False
        users = self.d.store.list_vms(mem_snapshot_id=snapshot_id)
        return not any(u.state not in FINAL for u in users)
