"""The dashboard's page of one VM: its state, timeline, snapshots and metrics, its
buttons, its files and its console."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from pal.api.body import MAX_FILE_BYTES, MAX_FILE_WORDS, json_value
from pal.api.exec_stream import sse_exec
from pal.api.paths import check_workspace_path
from pal.api.ports import port_link
from pal.errors import InvalidRequest, PalError, TooLarge
from pal.spec import ExecRequest

from .context import PORT_LINK_SECS, Dash, buttons_for, error_words
from .terminal import open_terminal

router = APIRouter(prefix="/runtime", include_in_schema=False)


# -- one VM --------------------------------------------------------------------------------


@router.get("/{vm_id}")
async def detail_page(request: Request, dash: Dash, vm_id: str) -> Response:
    s = await dash.session_for(request, "page")
    try:
        vm = await dash.scheduler.get(s.tenant_id, vm_id)
    except PalError as exc:
        status, words = error_words(exc)
        return dash.render(request, "error.html", status=status, text=words)
    network = await dash.scheduler.network(vm)
    return dash.render(request, "detail.html", vm=vm, network=network, buttons=buttons_for(vm))


@router.get("/{vm_id}/_state")
async def state_fragment(request: Request, dash: Dash, vm_id: str) -> Response:
    s = await dash.session_for(request, "fragment")
    vm = await dash.scheduler.get(s.tenant_id, vm_id)
    children = [v for v in await dash.scheduler.list(s.tenant_id) if v.parent_vm_id == vm_id]
    network = await dash.scheduler.network(vm)
    return dash.render(
        request, "_state.html", vm=vm, children=children, network=network, buttons=buttons_for(vm)
    )


TIMELINE_PAGE = 50  # events per page of the timeline, newest first


@router.get("/{vm_id}/_timeline")
async def timeline(request: Request, dash: Dash, vm_id: str, before: int | None = None) -> Response:
    """The newest page of the VM's events (polled), or the page older than ``before`` (the
    "Older events" button): a VM's log is never loaded whole."""
    s = await dash.session_for(request, "fragment")
    events = await dash.scheduler.events(s.tenant_id, vm_id, before=before, limit=TIMELINE_PAGE + 1)
    more = events[TIMELINE_PAGE - 1].id if len(events) > TIMELINE_PAGE else None
    return dash.render(
        request,
        "_timeline.html",
        events=events[:TIMELINE_PAGE],
        vm_id=vm_id,
        older=more,
        first=before is None,
    )


@router.get("/{vm_id}/_snapshots")
async def snapshots(request: Request, dash: Dash, vm_id: str) -> Response:
    s = await dash.session_for(request, "fragment")
    try:
        snaps = await dash.scheduler.snapshots(s.tenant_id, vm_id)
    except PalError as exc:
        return dash.message(request, error_words(exc)[1], 200)
    return dash.render(request, "_snapshots.html", snapshots=list(reversed(snaps)))


@router.get("/{vm_id}/metrics.json")
async def metrics(request: Request, dash: Dash, vm_id: str) -> Response:
    s = await dash.session_for(request, "json")
    m = await dash.scheduler.metrics(s.tenant_id, vm_id)
    return JSONResponse(m.model_dump(by_alias=True, mode="json"), headers={"Cache-Control": "no-store"})


@router.post("/{vm_id}/fork")
async def fork(request: Request, dash: Dash, vm_id: str) -> Response:
    s, form = await dash.mutating(request)

    async def act() -> str:
        try:
            count = int(form.get("count") or 1)
        except ValueError:
            raise InvalidRequest("the fork count must be a whole number") from None
        res = await dash.scheduler.fork(s.tenant_id, vm_id, count)
        parts = [f"{c.vm_id} {c.state}" + (f" ({c.error})" if c.error else "") for c in res.forks]
        return f"Forked {len(res.forks)}: " + ", ".join(parts) + "."

    return await dash.attempt(request, act, trigger="vmChanged")


@router.post("/{vm_id}/port-link")
async def open_port(request: Request, dash: Dash, vm_id: str) -> Response:
    s, form = await dash.mutating(request)
    try:
        port = int(str(form.get("port") or ""))
        if not 1 <= port <= 65535:
            raise ValueError
    except ValueError:
        return dash.message(request, error_words(InvalidRequest("give a port from 1 to 65535"))[1], 400)
    try:
        await dash.scheduler.get(s.tenant_id, vm_id)  # 404 for unknown and other tenants' VMs
    except PalError as exc:
        status, words = error_words(exc)
        return dash.message(request, words, status)
    state = request.app.state
    link = port_link(state.links, state.port_origins, s.tenant_id, s.key_hash, vm_id, port, PORT_LINK_SECS)
    expires = datetime.fromtimestamp(link.expires_at, UTC).strftime("%H:%M UTC")
    return dash.render(request, "_port_link.html", port=port, url=link.url, expires=expires)


# -- files ---------------------------------------------------------------------------------


@router.get("/{vm_id}/_files")
async def files(request: Request, dash: Dash, vm_id: str, path: str = "") -> Response:
    s = await dash.session_for(request, "fragment")
    try:
        checked = check_workspace_path(path, required=False)
        listing = await dash.scheduler.list_files(s.tenant_id, vm_id, checked)
    except PalError as exc:
        status, words = error_words(exc)
        return dash.message(request, words, status)
    entries = sorted(listing.entries, key=lambda e: (e.get("type") != "dir", str(e.get("name"))))
    parent = posixpath.dirname(path.rstrip("/")) if path.strip("/") else None
    return dash.render(
        request,
        "_files.html",
        vm_id=vm_id,
        path=path.strip("/"),
        parent=parent,
        entries=entries,
        truncated=listing.truncated,
        join=lambda name: posixpath.join(path.strip("/"), str(name)) if path.strip("/") else str(name),
    )


@router.get("/{vm_id}/files/view")
async def view_file(request: Request, dash: Dash, vm_id: str, path: str) -> Response:
    s = await dash.session_for(request, "fragment")
    try:
        data, truncated = await dash.scheduler.read_file(
            s.tenant_id, vm_id, check_workspace_path(path, required=True)
        )
    except PalError as exc:
        status, words = error_words(exc)
        return dash.message(request, words, status)
    text: str | None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return dash.render(
        request, "_file_view.html", vm_id=vm_id, path=path, text=text, size=len(data), truncated=truncated
    )


@router.get("/{vm_id}/files/download")
async def download(request: Request, dash: Dash, vm_id: str, path: str) -> Response:
    s = await dash.session_for(request, "page")
    data, truncated = await dash.scheduler.read_file(
        s.tenant_id, vm_id, check_workspace_path(path, required=True)
    )
    name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(path)) or "file"
    headers = {
        "Content-Disposition": f"attachment; filename=\"{name}\"; filename*=UTF-8''{quote(name)}",
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-store",
    }
    if truncated:
        headers["X-Pal-Truncated"] = "true"
    return Response(data, media_type="application/octet-stream", headers=headers)


@router.post("/{vm_id}/files/upload")
async def upload(request: Request, dash: Dash, vm_id: str) -> Response:
    s, form = await dash.mutating(request)
    upload = form.get("file")

    async def act() -> str:
        if not isinstance(upload, UploadFile) or not upload.filename:
            raise InvalidRequest("choose a file to upload")
        data = await upload.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise TooLarge(f"{upload.filename} is over {MAX_FILE_WORDS}; the limit is {MAX_FILE_BYTES} bytes")
        folder = str(form.get("dir") or "").strip("/")
        name = posixpath.basename(upload.filename.replace("\\", "/"))
        target = check_workspace_path(posixpath.join(folder, name) if folder else name, required=True)
        res = await dash.scheduler.write_file(s.tenant_id, vm_id, target, data)
        return f"Uploaded {res.path} ({res.bytes_written} bytes)."

    try:
        return await dash.attempt(request, act, trigger="filesChanged")
    finally:
        if isinstance(upload, UploadFile):
            await upload.close()


@router.post("/{vm_id}/terminal")
async def terminal(request: Request, vm_id: str, dash: Dash) -> Response:
    s, _ = await dash.mutating(request, "json")
    return await open_terminal(request, dash.scheduler, s, vm_id)


# -- exec console --------------------------------------------------------------------------


@router.post("/{vm_id}/exec")
async def exec_(request: Request, dash: Dash, vm_id: str) -> Response:
    s, _ = await dash.mutating(request, "json")
    try:
        body = json_value(await request.body() or b"{}")
        line = str(body.get("line", "")).strip()
        if not line:
            raise InvalidRequest("type a command")
        req = ExecRequest.model_validate({"command": "/bin/sh", "argv": ["-c", line]})
    except (ValueError, AttributeError, ValidationError):
        raise InvalidRequest('send {"line": "<shell command>"}') from None
    # The REST API's SSE path: same events, same errors, same cancel-on-disconnect.
    return await sse_exec(lambda: dash.scheduler.exec_stream(s.tenant_id, vm_id, req))


# Pause, Resume, Delete: a button each, the scheduler's call of that name, and what to
# say after it.
def simple_action(name: str, done: Callable[[Any], str]) -> Callable[..., Awaitable[Response]]:
    async def route(request: Request, vm_id: str, dash: Dash) -> Response:
        s, _ = await dash.mutating(request)

        async def act() -> str:
            return done(await getattr(dash.scheduler, name)(s.tenant_id, vm_id))

        return await dash.attempt(request, act, trigger="vmChanged")

    return route


for name, done in (
    ("pause", lambda v: f"Paused: snapshot {v.snapshot_id}."),
    ("resume", lambda v: f"Resumed ({v.state})."),
    ("delete", lambda v: f"Deleted ({v.state})."),
):
    router.add_api_route(f"/{{vm_id}}/{name}", simple_action(name, done), methods=["POST"], name=name)
