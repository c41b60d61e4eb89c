"""E2B's volumes (docs/e2b.md, "Volumes"): its REST calls (``/volumes``: list, create, get,
delete, with the tenant's key) and its volume content API (``/volumecontent/{volumeID}/
path|dir|file``, with the volume's token), over Pal's volumes (pal/scheduler/volumes.py)
and the node's volume files verbs: the same code as ``/v1/volumes``, the same hostile-volume
rules (a symlink is never followed, a fifo never opened, 1 MiB a file).

A volume's token (E2B's ``VolumeAndToken.token``, sent as ``Authorization: Bearer``) is
derived from the server's secret and the volume id, as a secure sandbox's access token is
(conventions.access_token): every replica derives the same, nothing is stored, and it opens
that one volume only (a deleted volume's id never comes back). Paths are E2B's: from the
volume's root, ``/`` first or not."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pal.api.volumes import VOLUME_NAME
from pal.errors import NotFound, TooLarge, Unauthorized
from pal.guest.protocol import MAX_FILE_BYTES
from pal.scheduler.volumes import Volumes
from pal.sizes import DEFAULT_VOLUME_MIB
from pal.wire import verbs
from pal.wire.volumes import VolumeEntry

from . import ops
from .versions import API_KEY_HEADER

TOKEN_PREFIX = b"e2b-volume-token:"
_TYPES = {"file": "file", "dir": "directory", "symlink": "symlink"}
LIST_PAGE = 1000


def volume_token(secret: bytes, volume_id: str) -> str:
    return hmac.new(secret, TOKEN_PREFIX + volume_id.encode(), hashlib.sha256).hexdigest()


def rel(path: str) -> str:
    """An E2B path (from the volume's root, ``/`` first or not) as Pal's relative one."""
    return path.lstrip("/")


def _time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def entry_json(e: VolumeEntry) -> dict[str, Any]:
    """E2B's ``VolumeEntryStat``."""
    out: dict[str, Any] = {
        "name": e.name, "type": _TYPES.get(e.type, "unknown"), "path": "/" + e.path, "size": e.size,
        "mode": e.mode, "uid": e.uid, "gid": e.gid,
        "atime": _time(e.atime), "mtime": _time(e.mtime), "ctime": _time(e.ctime),
    }  # fmt: skip
    if e.target is not None:
        out["target"] = e.target
    return out


class NewVolume(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=VOLUME_NAME, description="as Pal's: 1-63 of A-Z a-z 0-9 . _ -")


class Attrs(BaseModel):
    model_config = ConfigDict(extra="ignore")
    uid: int | None = Field(None, ge=0, le=65534)
    gid: int | None = Field(None, ge=0, le=65534)
    mode: int | None = Field(None, ge=0, le=0o777)


@dataclass(frozen=True)
class E2bVolumes:
    volumes: Volumes
    secret: bytes

    def and_token(self, volume_id: str, name: str) -> dict[str, Any]:
        return {"volumeID": volume_id, "name": name, "token": volume_token(self.secret, volume_id)}

    def owner(self, request: Request, volume_id: str) -> str:
        """The tenant of the volume whose token the request carries (401 for none or a
        wrong one, before anything is looked up)."""
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        expected = volume_token(self.secret, volume_id)
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
            raise Unauthorized("missing or wrong volume token (Authorization: Bearer <the volume's token>)")
        tenant = self.volumes.owner(volume_id)
        if tenant is None:
            raise NotFound(f"volume {volume_id} not found")
        return tenant


async def _tenant(request: Request) -> str:
    """The tenant of the request's ``X-API-KEY`` (as every E2B REST call: rest.py)."""
    key = request.headers.get(API_KEY_HEADER)
    if not key:
        raise Unauthorized("missing API key: send it in X-API-KEY (E2B_API_KEY)")
    check_key: ops.KeyCheck = request.app.state.check_key
    tenant_id, why = await check_key(key)
    if tenant_id is None:
        raise Unauthorized(why or "invalid API key")
    return tenant_id


Tenant = Annotated[str, Depends(_tenant)]


def volume_routes(vols: E2bVolumes) -> APIRouter:
    """``/volumes``: the tenant's volumes, by its API key."""
    r = APIRouter()

    @r.get("/volumes")
    async def list_volumes(t: Tenant) -> Response:
        out: list[dict[str, Any]] = []
        after = None
        while True:
            page = await vols.volumes.page(t, after=after, limit=LIST_PAGE, metadata={})
            out += [{"volumeID": v.volume_id, "name": v.name} for v in page]
            if len(page) < LIST_PAGE:
                return JSONResponse(out)
            after = (page[-1].created_at, page[-1].volume_id)

    @r.post("/volumes")
    async def create_volume(body: NewVolume, t: Tenant) -> Response:
        vol = await vols.volumes.create(t, body.name, DEFAULT_VOLUME_MIB, {})
        return JSONResponse(vols.and_token(vol.volume_id, vol.name), status_code=201)

    @r.get("/volumes/{volume_id}")
    async def get_volume(volume_id: str, t: Tenant) -> Response:
        vol, _ = await vols.volumes.get(t, volume_id)
        return JSONResponse(vols.and_token(vol.volume_id, vol.name))

    @r.delete("/volumes/{volume_id}")
    async def delete_volume(volume_id: str, t: Tenant) -> Response:
        await vols.volumes.delete(t, volume_id)
        return Response(status_code=204)

    return r


async def _body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise TooLarge(f"a file of a volume is at most {MAX_FILE_BYTES} bytes through this API")
        chunks.append(chunk)
    return b"".join(chunks)


_Path = Annotated[str, Query(min_length=1)]


def _content_path_routes(vols: E2bVolumes) -> APIRouter:
    """``/volumecontent/{volumeID}/path``: stat, chmod/chown, remove, by the volume's token."""
    r = APIRouter(prefix="/volumecontent/{volume_id}")
    files = vols.volumes.files

    @r.get("/path")
    async def get_path(volume_id: str, path: _Path, request: Request) -> Response:
        t = vols.owner(request, volume_id)
        return JSONResponse(entry_json(await files(t, volume_id, verbs.VOLUME_STAT, path=rel(path))))

    @r.patch("/path")
    async def patch_path(volume_id: str, path: _Path, body: Attrs, request: Request) -> Response:
        t = vols.owner(request, volume_id)
        got = await files(
            t, volume_id, verbs.VOLUME_SET_ATTRS, path=rel(path), mode=body.mode, uid=body.uid, gid=body.gid
        )
        return JSONResponse(entry_json(got))

    @r.delete("/path")
    async def delete_path(volume_id: str, path: _Path, request: Request) -> Response:
        t = vols.owner(request, volume_id)
        await files(t, volume_id, verbs.VOLUME_REMOVE, path=rel(path), recursive=True)
        return Response(status_code=204)

    return r


def _content_file_routes(vols: E2bVolumes) -> APIRouter:
    """``/volumecontent/{volumeID}/dir`` and ``/file``."""
    r = APIRouter(prefix="/volumecontent/{volume_id}")
    files = vols.volumes.files

    async def stat(t: str, volume_id: str, path: str) -> dict[str, Any]:
        return entry_json(await files(t, volume_id, verbs.VOLUME_STAT, path=path))

    async def chown(t: str, volume_id: str, path: str, uid: int | None, gid: int | None) -> None:
        if uid is not None or gid is not None:
            await files(t, volume_id, verbs.VOLUME_SET_ATTRS, path=path, uid=uid, gid=gid)

    @r.get("/dir")
    async def list_dir(
        volume_id: str, path: _Path, request: Request, depth: Annotated[int, Query(ge=1, le=16)] = 1
    ) -> Response:
        t = vols.owner(request, volume_id)
        listing = await files(t, volume_id, verbs.VOLUME_LIST, path=rel(path), depth=depth)
        return JSONResponse([entry_json(e) for e in listing.entries])

    @r.post("/dir")
    async def make_dir(
        volume_id: str,
        path: _Path,
        request: Request,
        uid: Annotated[int | None, Query(ge=0, le=65534)] = None,
        gid: Annotated[int | None, Query(ge=0, le=65534)] = None,
        mode: Annotated[int | None, Query(ge=0, le=0o777)] = None,
        force: bool = False,
    ) -> Response:
        t = vols.owner(request, volume_id)
        # an existing path without ``force`` is the node's 409
        await files(t, volume_id, verbs.VOLUME_MKDIR, path=rel(path), parents=force, mode=mode)
        await chown(t, volume_id, rel(path), uid, gid)
        return JSONResponse(await stat(t, volume_id, rel(path)), status_code=201)

    @r.get("/file")
    async def read_file(volume_id: str, path: _Path, request: Request) -> Response:
        t = vols.owner(request, volume_id)
        got = await files(t, volume_id, verbs.VOLUME_READ, path=rel(path))
        if got.truncated:
            raise TooLarge(
                f"{path} is {got.size} bytes; a file of a volume is read whole up to {MAX_FILE_BYTES} "
                "bytes through this API (read it in a sandbox that mounts the volume)"
            )
        return Response(got.data, media_type="application/octet-stream")

    @r.put("/file")
    async def write_file(
        volume_id: str,
        path: _Path,
        request: Request,
        uid: Annotated[int | None, Query(ge=0, le=65534)] = None,
        gid: Annotated[int | None, Query(ge=0, le=65534)] = None,
        mode: Annotated[int | None, Query(ge=0, le=0o777)] = None,
        force: bool | None = None,
    ) -> Response:
        del force  # a write always replaces the file (E2B's write_file: "overwrites")
        t = vols.owner(request, volume_id)
        data = await _body(request)
        await files(t, volume_id, verbs.VOLUME_WRITE, path=rel(path), data=data, mode=mode)
        await chown(t, volume_id, rel(path), uid, gid)
        return JSONResponse(await stat(t, volume_id, rel(path)), status_code=201)

    return r


def routers(volumes: Volumes, secret: bytes) -> list[APIRouter]:
    vols = E2bVolumes(volumes, secret)
    return [volume_routes(vols), _content_path_routes(vols), _content_file_routes(vols)]
