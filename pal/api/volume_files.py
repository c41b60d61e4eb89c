"""A volume's files without a sandbox (docs/volumes.md, "Files"): the shapes, codes and
limits of a sandbox's files API (routes.py), over the node's volume content verbs
(pal/wire/verbs.py ``VOLUME_*``; pal/manager/volume_content.py), plus stat and mkdir. The
node walks every path without following a symlink; another tenant's volume is a 404."""

# No `from __future__ import annotations`: FastAPI must resolve the local aliases.

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import Field

from pal.wire import verbs
from pal.wire.volumes import MAX_LIST_DEPTH, VolumeEntry

from .body import MAX_FILE_WORDS, content_type, read_bounded
from .deps import Tenant
from .errors import error_responses
from .models import FileDeletedOut, FileWrittenOut, _Out
from .volumes import VolumesOf

volume_files_router = APIRouter(
    prefix="/v1/volumes",
    tags=["volumes"],
    responses=error_responses(400, 401, 404, 409, 503),
)
_Path = Annotated[str, Query(description="relative to the volume's root; symlinks are not followed")]


class VolumeEntryOut(_Out):
    name: str
    type: str = Field(description="file | dir | symlink | other (a fifo, socket or device)")
    size: int
    path: str = Field(description="from the volume's root")
    mode: int = Field(description="the permission bits")
    uid: int
    gid: int
    modified_at: datetime
    target: str | None = Field(default=None, description="a symlink's target, as written")
    _omit_null = frozenset({"target"})

    @classmethod
    def of(cls, e: VolumeEntry) -> "VolumeEntryOut":
        return cls(
            name=e.name, type=e.type, size=e.size, path=e.path, mode=e.mode, uid=e.uid, gid=e.gid,
            modified_at=datetime.fromtimestamp(e.mtime, UTC), target=e.target,
        )  # fmt: skip


class VolumeFileListOut(_Out):
    path: str
    entries: list[VolumeEntryOut]
    truncated: bool


class VolumeDirOut(_Out):
    path: str
    created: bool = Field(description="false: it was there (`parents=true`)")


@volume_files_router.get(
    "/{volume}/files",
    response_model=VolumeFileListOut,
    summary="List a directory of a volume (at most 1000 entries: `truncated`)",
)
async def list_volume_files(
    tenant: Tenant,
    volumes: VolumesOf,
    volume: str,
    path: _Path = "",
    depth: Annotated[int, Query(ge=1, le=MAX_LIST_DEPTH, description="levels down (1: its own)")] = 1,
) -> VolumeFileListOut:
    res = await volumes.files(tenant, volume, verbs.VOLUME_LIST, path=path, depth=depth)
    entries = [VolumeEntryOut.of(e) for e in res.entries]
    return VolumeFileListOut(path=res.path, entries=entries, truncated=res.truncated)


@volume_files_router.get(
    "/{volume}/files/stat",
    response_model=VolumeEntryOut,
    summary="What is at a path (404 FILE_NOT_FOUND: nothing); a symlink is not followed",
)
async def stat_volume_file(
    tenant: Tenant, volumes: VolumesOf, volume: str, path: _Path = ""
) -> VolumeEntryOut:
    return VolumeEntryOut.of(await volumes.files(tenant, volume, verbs.VOLUME_STAT, path=path))


@volume_files_router.get(
    "/{volume}/files/content",
    response_class=Response,
    summary="Read a file of a volume",
    responses={
        200: {
            "content": {"text/plain": {}, "application/octet-stream": {}},
            "description": f"the file's bytes, cut at {MAX_FILE_WORDS} (`X-Pal-Truncated: true`); "
            "`text/plain; charset=utf-8` when they are UTF-8, else `application/octet-stream`",
        }
    },
)
async def read_volume_file(tenant: Tenant, volumes: VolumesOf, volume: str, path: _Path) -> Response:
    got = await volumes.files(tenant, volume, verbs.VOLUME_READ, path=path)
    headers = {"X-Pal-Truncated": "true"} if got.truncated else {}
    return Response(got.data, media_type=content_type(got.data, got.truncated), headers=headers)


@volume_files_router.put(
    "/{volume}/files/content",
    response_model=FileWrittenOut,
    summary=f"Write a file of a volume (at most {MAX_FILE_WORDS}; 507 past the volume's sizeMib)",
    responses=error_responses(413, 507),
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
)
async def write_volume_file(
    tenant: Tenant, volumes: VolumesOf, volume: str, path: _Path, request: Request
) -> FileWrittenOut:
    data = await read_bounded(request)
    res = await volumes.files(tenant, volume, verbs.VOLUME_WRITE, path=path, data=data)
    return FileWrittenOut(path=res.path, bytes_written=res.bytes_written)


@volume_files_router.post(
    "/{volume}/files/dir",
    response_model=VolumeDirOut,
    summary="Make a directory of a volume (`parents=true`: mkdir -p)",
)
async def make_volume_dir(
    tenant: Tenant,
    volumes: VolumesOf,
    volume: str,
    path: _Path,
    parents: Annotated[bool, Query(description="make missing parents; no error if it exists")] = False,
) -> VolumeDirOut:
    res = await volumes.files(tenant, volume, verbs.VOLUME_MKDIR, path=path, parents=parents)
    return VolumeDirOut(path=res.path, created=res.created)


@volume_files_router.delete(
    "/{volume}/files/content",
    response_model=FileDeletedOut,
    summary="Remove a file or symlink of a volume; a directory with `recursive=true`",
)
async def delete_volume_file(
    tenant: Tenant,
    volumes: VolumesOf,
    volume: str,
    path: _Path,
    recursive: Annotated[bool, Query(description="a directory and all in it")] = False,
) -> FileDeletedOut:
    res = await volumes.files(tenant, volume, verbs.VOLUME_REMOVE, path=path, recursive=recursive)
    return FileDeletedOut(path=res.path, deleted=res.deleted)
