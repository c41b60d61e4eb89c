"""The dashboard's Volumes pages (docs/dashboard.md, docs/volumes.md): the tenant's volumes
(list, create, delete) and one volume's files (browse, view, download, upload, remove),
through the same scheduler operations the REST API calls (pal/scheduler/volumes.py), in
this process. The node walks every path of a volume without following a symlink; names
and contents are shown as text."""

from __future__ import annotations

import posixpath
import re
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from pal.api.body import MAX_FILE_BYTES, MAX_FILE_WORDS
from pal.api.volumes import VolumeCreate
from pal.errors import InvalidRequest, PalError, TooLarge
from pal.wire import verbs

from .context import Dash, error_words

router = APIRouter(prefix="/runtime/volumes", include_in_schema=False)
PAGE = 1000  # volumes listed on the page (a tenant's volume count is small; the quota bounds it)


async def _volumes(dash: Any, tenant_id: str) -> list[Any]:
    return await dash.scheduler.volumes.page(tenant_id, after=None, limit=PAGE, metadata={})


@router.get("")
async def volumes_page(request: Request, dash: Dash) -> Response:
    s = await dash.session_for(request, "page")
    return dash.render(request, "volumes.html", volumes=await _volumes(dash, s.tenant_id))


@router.get("/_rows")
async def volume_rows(request: Request, dash: Dash) -> Response:
    s = await dash.session_for(request, "fragment")
    return dash.render(request, "_volume_rows.html", volumes=await _volumes(dash, s.tenant_id))


@router.post("/create")
async def create(request: Request, dash: Dash) -> Response:
    s, form = await dash.mutating(request)

    async def act() -> str:
        body: dict[str, Any] = {"name": str(form.get("name") or "").strip()}
        try:
            if form.get("sizeMib"):
                body["sizeMib"] = int(form["sizeMib"])
            req = VolumeCreate.model_validate(body)
        except (ValueError, ValidationError) as exc:
            raise InvalidRequest(f"check the name and the size: {exc}") from None
        vol = await dash.scheduler.volumes.create(s.tenant_id, req.name, req.size_mib, {})
        return f"Created volume {vol.name} ({vol.volume_id}, {vol.size_mib} MiB)."

    return await dash.attempt(request, act, trigger="volumesChanged")


@router.post("/{volume}/delete")
async def delete(request: Request, dash: Dash, volume: str) -> Response:
    s, _ = await dash.mutating(request)

    async def act() -> str:
        vol = await dash.scheduler.volumes.delete(s.tenant_id, volume)
        return f"Deleted volume {vol.name} and its files."

    return await dash.attempt(request, act, trigger="volumesChanged")


@router.get("/{volume}")
async def volume_page(request: Request, dash: Dash, volume: str) -> Response:
    s = await dash.session_for(request, "page")
    try:
        vol, mounts = await dash.scheduler.volumes.get(s.tenant_id, volume)
    except PalError as exc:
        status, words = error_words(exc)
        return dash.render(request, "error.html", status=status, text=words)
    return dash.render(request, "volume.html", vol=vol, mounts=mounts)


def _join(folder: str, name: str) -> str:
    return posixpath.join(folder, name) if folder else name


@router.get("/{volume}/_files")
async def files(request: Request, dash: Dash, volume: str, path: str = "") -> Response:
    s = await dash.session_for(request, "fragment")
    folder = path.strip("/")
    try:
        listing = await dash.scheduler.volumes.files(s.tenant_id, volume, verbs.VOLUME_LIST, path=folder)
    except PalError as exc:
        status, words = error_words(exc)
        return dash.message(request, words, status)
    entries = sorted(listing.entries, key=lambda e: (e.type != "dir", e.name))
    parent = posixpath.dirname(folder) if folder else None
    return dash.render(
        request, "_volume_files.html", volume=volume, path=folder, parent=parent, entries=entries,
        truncated=listing.truncated, join=lambda name: _join(folder, name),
    )  # fmt: skip


@router.get("/{volume}/files/view")
async def view_file(request: Request, dash: Dash, volume: str, path: str) -> Response:
    s = await dash.session_for(request, "fragment")
    try:
        got = await dash.scheduler.volumes.files(s.tenant_id, volume, verbs.VOLUME_READ, path=path)
    except PalError as exc:
        status, words = error_words(exc)
        return dash.message(request, words, status)
    text: str | None
    try:
        text = got.data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return dash.render(
        request, "_volume_file_view.html", volume=volume, path=path, text=text, size=got.size,
        truncated=got.truncated,
    )  # fmt: skip


@router.get("/{volume}/files/download")
async def download(request: Request, dash: Dash, volume: str, path: str) -> Response:
    s = await dash.session_for(request, "page")
    got = await dash.scheduler.volumes.files(s.tenant_id, volume, verbs.VOLUME_READ, path=path)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(path)) or "file"
    headers = {
        "Content-Disposition": f"attachment; filename=\"{name}\"; filename*=UTF-8''{quote(name)}",
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-store",
    }
    if got.truncated:
        headers["X-Pal-Truncated"] = "true"
    return Response(got.data, media_type="application/octet-stream", headers=headers)


@router.post("/{volume}/files/upload")
async def upload(request: Request, dash: Dash, volume: str) -> Response:
    s, form = await dash.mutating(request)
    upload = form.get("file")

    async def act() -> str:
        if not isinstance(upload, UploadFile) or not upload.filename:
            raise InvalidRequest("choose a file to upload")
        data = await upload.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise TooLarge(f"{upload.filename} is over {MAX_FILE_WORDS}; the limit is {MAX_FILE_BYTES} bytes")
        name = posixpath.basename(upload.filename.replace("\\", "/"))
        target = _join(str(form.get("dir") or "").strip("/"), name)
        res = await dash.scheduler.volumes.files(
            s.tenant_id, volume, verbs.VOLUME_WRITE, path=target, data=data
        )
        return f"Uploaded {res.path} ({res.bytes_written} bytes)."

    try:
        return await dash.attempt(request, act, trigger="filesChanged")
    finally:
        if isinstance(upload, UploadFile):
            await upload.close()


@router.post("/{volume}/files/remove")
async def remove(request: Request, dash: Dash, volume: str) -> Response:
    s, form = await dash.mutating(request)

    async def act() -> str:
        path = str(form.get("path") or "")
        recursive = form.get("recursive") == "true"
        res = await dash.scheduler.volumes.files(
            s.tenant_id, volume, verbs.VOLUME_REMOVE, path=path, recursive=recursive
        )
        return f"Removed {res.path}."

    return await dash.attempt(request, act, trigger="filesChanged")
