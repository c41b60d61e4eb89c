"""Volumes (docs/volumes.md): create, list, get, resize and delete, each a row in the store
(pal/store/volumes.py: the tenant's volume limits checked and counted in the row's
transaction) and the volume's storage on the node that holds it (the node's volume verbs,
pal/wire/verbs.py; pal/manager/volumes.py).

A volume is made on one node: the embedded node of `pal up`, or in a cluster the first
active node (its ``node_id`` is kept; every later call goes there). With PAL_VOLUMES_DIR
(a directory every node mounts) a volume has no home: a call goes to its recorded node
while that one serves, else to any active node, all of which see the same files. Its name
is unique
within its tenant; the API finds a volume by id or by name. Each operation on a volume
holds its lock (``VmLocks.op_lock`` of the volume's id: the ids never meet VMs').
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel

from pal.errors import Conflict, InvalidRequest, Unavailable, VolumeNotFound
from pal.scheduler import nodes as nodes_mod
from pal.scheduler.deps import Deps, as_pal
from pal.store import VolumeRecord, utcnow
from pal.store import volumes as rows
from pal.wire import verbs
from pal.wire.handlers import NodeCalls
from pal.wire.verbs import Call
from pal.wire.volumes import VolumeCreate, VolumeRef, VolumeResize

log = logging.getLogger(__name__)
VOLUME_ID_PREFIX = "vol-"
Ans = TypeVar("Ans", bound=BaseModel)


def new_volume_id() -> str:
    return VOLUME_ID_PREFIX + uuid.uuid4().hex[:24]


class VolumeMounted(Conflict):
    """A delete of a volume that VMs mount, without ``force`` (409)."""

    code = "VOLUME_MOUNTED"


@dataclass(frozen=True)
class Volumes:
    d: Deps

    # -- finding them ----------------------------------------------------------------------

    def own(self, tenant_id: str, ref: str) -> VolumeRecord:
        """The tenant's volume of id or name ``ref``; 404 for another tenant's as for none."""
        store = self.d.store
        vol = rows.get(store, ref) if ref.startswith(VOLUME_ID_PREFIX) else None
        if vol is None or vol.tenant_id != tenant_id:
            vol = rows.by_name(store, tenant_id, ref)
        if vol is None:
            raise VolumeNotFound(f"volume {ref[:80]!r} not found")
        return vol

    def owner(self, volume_id: str) -> str | None:
        """The tenant of the volume of id ``volume_id`` (None: no such volume); for a caller
        that holds a credential of the volume itself (the E2B surface's volume token)."""
        vol = rows.get(self.d.store, volume_id) if volume_id.startswith(VOLUME_ID_PREFIX) else None
        return vol.tenant_id if vol is not None else None

    def _serves(self, node_id: str) -> bool:
        rec = next((r for r in self.d.nodes.nodes() if r.node_id == node_id), None)
        return (
            rec is not None
            and rec.state == nodes_mod.ACTIVE
            and rec.healthy
            and not self.d.nodes.silent(node_id)
        )

    def _node(self, vol: VolumeRecord) -> NodeCalls:
        if self.d.settings.volumes_shared and vol.node_id is not None and not self._serves(vol.node_id):
            for rec in self.d.nodes.nodes():  # a shared volumes dir: any node reaches it
                if self._serves(rec.node_id):
                    return self.d.nodes.client(rec.node_id)
            raise Unavailable(f"no active node to reach volume {vol.name!r}")
        if self.d.nodes.state_of(vol.node_id) == nodes_mod.LOST:
            raise Unavailable(f"the node that holds volume {vol.name!r} ({vol.node_id}) is lost")
        return self.d.nodes.client(vol.node_id)

    async def _home(self) -> str:
        """The node a new volume is made on: the embedded one, else the first active node."""
        await self.d.nodes.register_local()  # names an embedded node not named yet
        local = self.d.nodes.local_ids()
        if local:
            return local[0]
        for rec in self.d.nodes.nodes():
            if rec.state == nodes_mod.ACTIVE and rec.healthy and not self.d.nodes.silent(rec.node_id):
                return rec.node_id
        raise Unavailable("no active node to hold a volume")

    # -- the operations --------------------------------------------------------------------

    async def create(
        self, tenant_id: str, name: str, size_mib: int, metadata: dict[str, str]
    ) -> VolumeRecord:
        """Prerequisites: the tenant has no volume of that name (409) and room for one more
        of that size (402). Success: ``ready``, its storage made on its node. Failure: no row
        and nothing on the node; the tenant's counts as before."""
        now = utcnow()
        vol = VolumeRecord(
            volume_id=new_volume_id(), tenant_id=tenant_id, name=name, size_mib=size_mib, state="creating",
            created_at=now, updated_at=now, node_id=await self._home(), metadata=dict(metadata),
        )  # fmt: skip
        async with self.d.locks.op_lock(vol.volume_id):
            rows.create(self.d.store, vol)
            try:
                req = VolumeCreate(volume_id=vol.volume_id, tenant_id=tenant_id, size_mib=size_mib)
                await self._node(vol).call(verbs.CREATE_VOLUME, req)
            except Exception as exc:
                # A node that made it and failed after (a lost answer) must not keep it.
                with contextlib.suppress(Exception):
                    await self._node(vol).call(verbs.DELETE_VOLUME, VolumeRef(volume_id=vol.volume_id))
                rows.remove(self.d.store, vol.volume_id)
                raise as_pal(exc) from exc
            return rows.set_state(self.d.store, vol.volume_id, "ready", expect="creating")

    async def files(self, tenant_id: str, ref: str, verb: Call[Any, Ans], **fields: Any) -> Ans:
        """A call of a volume's files API (``verbs.VOLUME_*``) on its node, the request made
        of ``fields`` and the volume's id. Prerequisites: the tenant's volume (404), ready
        (409)."""
        vol = self.own(tenant_id, ref)
        if vol.state != "ready":
            raise Conflict(f"volume {vol.name!r} is {vol.state}")
        req = verb.request.model_validate({**fields, "volume_id": vol.volume_id})
        return await self._node(vol).call(verb, req)

    async def page(
        self, tenant_id: str, *, after: tuple[datetime, str] | None, limit: int, metadata: dict[str, str]
    ) -> list[VolumeRecord]:
        """Up to ``limit`` of the tenant's volumes, oldest first, after ``after``."""
        return rows.page(self.d.store, tenant_id, after=after, limit=limit, metadata=metadata)

    async def get(self, tenant_id: str, ref: str) -> tuple[VolumeRecord, list[str]]:
        """The volume and the VMs that mount it."""
        vol = self.own(tenant_id, ref)
        return vol, rows.mounted_by(self.d.store, vol.volume_id)

    async def resize(self, tenant_id: str, ref: str, size_mib: int) -> VolumeRecord:
        """Prerequisites: the tenant's ready volume (404, 409); ``size_mib`` no smaller than
        its size (400); room for the difference (402). Success: its new size, on its node
        too. Failure: its size as before."""
        vol = self.own(tenant_id, ref)
        async with self.d.locks.op_lock(vol.volume_id):
            vol = self.own(tenant_id, vol.volume_id)
            if size_mib < vol.size_mib:
                raise InvalidRequest(
                    f"volume {vol.name!r} is {vol.size_mib} MiB; a volume only grows (asked {size_mib} MiB)"
                )
            if size_mib == vol.size_mib:
                return vol
            grown = rows.resize(self.d.store, vol.volume_id, size_mib)
            try:
                req = VolumeResize(volume_id=vol.volume_id, size_mib=size_mib)
                await self._node(vol).call(verbs.RESIZE_VOLUME, req)
            except Exception as exc:
                rows.resize(self.d.store, vol.volume_id, vol.size_mib)  # frees what it took
                raise as_pal(exc) from exc
            return grown

    async def delete(self, tenant_id: str, ref: str, *, force: bool = False) -> VolumeRecord:
        """Prerequisites: the tenant's volume (404); no VM mounts it, unless ``force`` (409
        VOLUME_MOUNTED). Success: its files and row gone, the tenant's counts lowered.
        Failure: 503 when its node cannot delete it; it stays ``deleting`` and a repeated
        delete finishes it."""
        vol = self.own(tenant_id, ref)
        return await self._delete(vol, force=force)

    async def _delete(self, vol: VolumeRecord, *, force: bool) -> VolumeRecord:
        async with self.d.locks.op_lock(vol.volume_id):
            current = rows.get(self.d.store, vol.volume_id)
            if current is None:
                return VolumeRecord(**{**vol.__dict__, "state": "deleted"})
            mounts = rows.mounted_by(self.d.store, vol.volume_id)
            if mounts and not force:
                shown = ", ".join(mounts[:8]) + (f" and {len(mounts) - 8} more" if len(mounts) > 8 else "")
                raise VolumeMounted(
                    f"volume {vol.name!r} is mounted by {shown}: delete those VMs first, or delete "
                    "it with force (their mounts then fail)"
                )
            # Under its lock a create has finished: a volume still `creating` is one whose
            # create died with its process; the node's delete is idempotent either way.
            if current.state != "deleting":
                rows.set_state(self.d.store, vol.volume_id, "deleting")
            try:
                await self._node(current).call(verbs.DELETE_VOLUME, VolumeRef(volume_id=vol.volume_id))
            except Exception as exc:
                err = as_pal(exc)
                raise Unavailable(
                    f"deleting volume {vol.name!r} on its node failed: {err.message}; delete it again"
                ) from exc
            rows.remove(self.d.store, vol.volume_id)
            return VolumeRecord(**{**current.__dict__, "state": "deleted", "updated_at": utcnow()})

    async def purge(self, tenant_id: str) -> bool:
        """A removed tenant's volumes, files and all (delete.py's purge); True when none is
        left."""
        left = False
        for vol in rows.of_tenant(self.d.store, tenant_id):
            try:
                await self._delete(vol, force=True)
            except Exception as exc:
                left = True
                log.warning("deleting volume %s of a removed tenant: %s (retried)", vol.volume_id, exc)
        return not left
