"""Kept snapshots (docs/lifecycle.md, "Kept snapshots"): thin adapters from HTTP to the
scheduler's operation (pal/scheduler/kept.py), with the API's own shapes. A snapshot is
named in a path by its id or by its name; another tenant's is a 404."""

# No `from __future__ import annotations`: FastAPI must resolve the local aliases.

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from pal.scheduler.kept import NAME, KeptSnapshots
from pal.spec import Metadata, Secrets
from pal.store.kept import KeptSnapshot

from . import pagination as pages
from .body import require_json
from .deps import Tenant, scheduler_of
from .errors import error_responses
from .models import ForkOut, _Out, _Page


class _In(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", strict=True)


class KeepSnapshot(_In):
    name: str | None = Field(
        None,
        pattern=NAME.pattern,
        description="unique among the tenant's kept snapshots (taken again: it moves to the new one); "
        "1-100 of A-Z a-z 0-9 . _ -, not an image's name nor `snap-...`",
    )


class StartFromSnapshot(_In):
    count: int = Field(1, description="number of VMs, 1..PAL_MAX_FORK_COUNT")
    metadata: Metadata | None = Field(
        None,
        description="each new VM's tags, as a schedule's (the same rules), instead of the source's;"
        " absent: the source's tags",
    )
    secrets: Secrets | None = Field(
        None,
        description="env vars for every exec (a schedule's `secrets`, the same rules), set over the"
        " source's in each new VM; absent: the source's",
    )


class KeptSnapshotOut(_Out):
    snapshot_id: str
    name: str | None = None
    source_vm_id: str = Field(description="the VM it was taken of (it may be gone)")
    created_at: datetime
    _omit_null = frozenset({"name"})

    @classmethod
    def of(cls, k: KeptSnapshot) -> "KeptSnapshotOut":
        return cls(
            snapshot_id=k.snapshot_id, name=k.name, source_vm_id=k.source_vm_id, created_at=k.created_at
        )


class KeptSnapshotListOut(_Page):
    snapshots: list[KeptSnapshotOut]


def _kept(request: Request) -> KeptSnapshots:
    return scheduler_of(request.app.state).kept


KeptOf = Annotated[KeptSnapshots, Depends(_kept)]
kept_router = APIRouter(
    prefix="/v1/runtime", tags=["snapshots"], responses=error_responses(400, 401, 402, 404, 409, 503)
)
_JSON: dict[str, Any] = {"dependencies": [Depends(require_json)], "responses": error_responses(415)}


@kept_router.post(
    "/vms/{vm_id}/snapshots",
    response_model=KeptSnapshotOut,
    response_model_exclude_none=True,
    summary="Keep a snapshot of the VM (by a name): out of its retention, past its delete; VMs start from it",
    **_JSON,
)
async def keep_snapshot(tenant: Tenant, kept: KeptOf, vm_id: str, req: KeepSnapshot) -> KeptSnapshotOut:
    return KeptSnapshotOut.of(await kept.keep(tenant, vm_id, req.name))


@kept_router.get(
    "/snapshots",
    response_model=KeptSnapshotListOut,
    response_model_exclude_none=True,
    summary="The tenant's kept snapshots, oldest first, a page at a time",
)
async def list_kept_snapshots(
    tenant: Tenant,
    kept: KeptOf,
    vm_id: Annotated[str | None, Query(alias="vmId", max_length=64, description="of this VM")] = None,
    name: Annotated[str | None, Query(max_length=200, description="of this name or id")] = None,
    limit: pages.Limit = None,
    cursor: pages.Cursor = None,
) -> KeptSnapshotListOut:
    size, after = pages.page_size(limit), pages.dated_after("kept-snapshots", cursor)
    found = kept.list(tenant, vm_id=vm_id, name=name, after=after, limit=size + 1)
    page, nxt = pages.next_cursor(
        "kept-snapshots", found, size, lambda k: (k.created_at.isoformat(), k.snapshot_id)
    )
    return KeptSnapshotListOut(snapshots=[KeptSnapshotOut.of(k) for k in page], next_cursor=nxt)


@kept_router.get(
    "/snapshots/{snapshot}",
    response_model=KeptSnapshotOut,
    response_model_exclude_none=True,
    summary="A kept snapshot, by id or name",
)
async def get_kept_snapshot(tenant: Tenant, kept: KeptOf, snapshot: str) -> KeptSnapshotOut:
    return KeptSnapshotOut.of(kept.get(tenant, snapshot))


@kept_router.delete(
    "/snapshots/{snapshot}",
    response_model=KeptSnapshotOut,
    response_model_exclude_none=True,
    summary="Let a kept snapshot go (its files too, once its VM no longer needs them)",
)
async def delete_kept_snapshot(tenant: Tenant, kept: KeptOf, snapshot: str) -> KeptSnapshotOut:
    return KeptSnapshotOut.of(await kept.delete(tenant, snapshot))


@kept_router.post(
    "/snapshots/{snapshot}/start",
    response_model=ForkOut,
    response_model_exclude_none=True,
    summary="New VMs from a kept snapshot: its memory, disk and processes, each its own identity",
    **_JSON,
)
async def start_from_snapshot(tenant: Tenant, kept: KeptOf, snapshot: str, req: StartFromSnapshot) -> ForkOut:
    return ForkOut.model_validate(await kept.start(tenant, snapshot, req.count, req.metadata, req.secrets))
