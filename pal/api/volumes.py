"""The /v1/volumes routes (docs/volumes.md): thin adapters from HTTP to the scheduler's
volume operations (pal/scheduler/volumes.py), with the API's own request and answer
shapes. A volume is named in a path by its id or by its name; another tenant's is a 404."""

# No `from __future__ import annotations`: FastAPI must resolve the local aliases.

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from pal.scheduler.volumes import Volumes
from pal.sizes import DEFAULT_VOLUME_MIB, VOLUME_MIB_RANGE
from pal.spec import check_metadata
from pal.store import VolumeRecord

from . import pagination as pages
from .body import require_json
from .deps import Tenant, scheduler_of
from .errors import error_responses
from .models import _Out, _Page

VOLUME_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
_Size = Annotated[
    int,
    Field(ge=VOLUME_MIB_RANGE[0], le=VOLUME_MIB_RANGE[1], description="MiB; a limit, allocated as written"),
]


class _In(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


class VolumeCreate(_In):
    name: str = Field(
        pattern=VOLUME_NAME, description="unique among the tenant's volumes: 1-63 of A-Z a-z 0-9 . _ -"
    )
    size_mib: _Size = DEFAULT_VOLUME_MIB
    metadata: dict[str, str] = Field(default_factory=dict, description="the tenant's tags, as a VM's")

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: object) -> dict[str, str]:
        return check_metadata(v)


class VolumeResize(_In):
    size_mib: _Size


class VolumeOut(_Out):
    volume_id: str
    name: str
    size_mib: int
    state: str = Field(description="creating | ready | deleting | deleted (a delete's answer)")
    metadata: dict[str, str]
    created_at: datetime
    updated_at: datetime
    mounted_by: list[str] | None = Field(
        default=None, description="the VMs that mount it (GET of one volume)"
    )
    _omit_null = frozenset({"mounted_by"})

    @classmethod
    def of(cls, vol: VolumeRecord, mounted_by: list[str] | None = None) -> "VolumeOut":
        out = cls.model_validate(vol)
        out.mounted_by = mounted_by
        return out


class VolumeListOut(_Page):
    volumes: list[VolumeOut]


def _volumes(request: Request) -> Volumes:
    return scheduler_of(request.app.state).volumes


VolumesOf = Annotated[Volumes, Depends(_volumes)]
volumes_router = APIRouter(
    prefix="/v1/volumes", tags=["volumes"], responses=error_responses(400, 401, 402, 404, 409, 503)
)
_JSON: dict[str, Any] = {"dependencies": [Depends(require_json)], "responses": error_responses(415)}


@volumes_router.post("", response_model=VolumeOut, summary="Create a volume", **_JSON)
async def create_volume(tenant: Tenant, volumes: VolumesOf, req: VolumeCreate) -> VolumeOut:
    return VolumeOut.of(await volumes.create(tenant, req.name, req.size_mib, req.metadata))


@volumes_router.get(
    "",
    response_model=VolumeListOut,
    summary="List the tenant's volumes, a page at a time; `?metadata.k=v` (repeatable: all must match)",
)
async def list_volumes(
    tenant: Tenant,
    volumes: VolumesOf,
    request: Request,
    limit: pages.Limit = None,
    cursor: pages.Cursor = None,
) -> VolumeListOut:
    size, wanted = pages.page_size(limit), pages.metadata_filter(request)
    after = pages.dated_after("volumes", cursor)
    found = await volumes.page(tenant, after=after, limit=size + 1, metadata=wanted)
    page, nxt = pages.next_cursor("volumes", found, size, lambda v: (v.created_at.isoformat(), v.volume_id))
    return VolumeListOut(volumes=[VolumeOut.of(v) for v in page], next_cursor=nxt)


@volumes_router.get("/{volume}", response_model=VolumeOut, summary="A volume, by id or name")
async def get_volume(tenant: Tenant, volumes: VolumesOf, volume: str) -> VolumeOut:
    vol, mounts = await volumes.get(tenant, volume)
    return VolumeOut.of(vol, mounts)


@volumes_router.delete(
    "/{volume}",
    response_model=VolumeOut,
    summary="Delete a volume and its files (409 while VMs mount it, unless `force`)",
)
async def delete_volume(
    tenant: Tenant,
    volumes: VolumesOf,
    volume: str,
    force: Annotated[bool, Query(description="delete it even while VMs mount it")] = False,
) -> VolumeOut:
    return VolumeOut.of(await volumes.delete(tenant, volume, force=force))


@volumes_router.post(
    "/{volume}/resize", response_model=VolumeOut, summary="Grow a volume (a smaller size is a 400)", **_JSON
)
async def resize_volume(tenant: Tenant, volumes: VolumesOf, volume: str, req: VolumeResize) -> VolumeOut:
    return VolumeOut.of(await volumes.resize(tenant, volume, req.size_mib))
