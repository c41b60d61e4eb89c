"""The dashboard's page of one VM: its state, timeline, snapshots and metrics, its
buttons, its files and its console."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
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
from pal.scheduler.scheduler import Scheduler
from pal.spec import ExecRequest
from pal.wire import verbs
from pal.wire.models import ExecCall, FileRef, FilesAt, FileWrite, on_vm

from .context import PORT_LINK_SECS, Dash, buttons_for, error_words
from .terminal import open_terminal

router = APIRouter(prefix="/runtime", include_in_schema=False)


# -- one VM --------------------------------------------------------------------------------


@router.get("/{vm_id}")
async def detail_page(request: Request, dash: Dash, vm_id: str) -> Response:
    s = await dash.session_for(request, "page")
    try:
        vm = await dash.scheduler.reads.get(s.tenant_id, vm_id)
    except PalError as exc:
        status, words = error_words(exc)
        return dash.render(request, "error.html", status=status, text=words)
    network = await dash.scheduler.reads.network(vm)
    return dash.render(request, "detail.html", vm=vm, network=network, buttons=buttons_for(vm))


@router.get("/{vm_id}/_state")
async def state_fragment(request: Request, dash: Dash, vm_id: str) -> Response:
    s = await dash.session_for(request, "fragment")
    vm = await dash.scheduler.reads.get(s.tenant_id, vm_id)
    children = [v for v in await dash.scheduler.reads.list_vms(s.tenant_id) if v.parent_vm_id == vm_id]
    network = await dash.scheduler.reads.network(vm)
    return dash.render(
        request, "_state.html", vm=vm, children=children, network=network, buttons=buttons_for(vm)
    )


TIMELINE_PAGE = 50  # events per page of the timeline, newest first


@router.get("/{vm_id}/_timeline")
async def timeline(request: Request, dash: Dash, vm_id: str, before: int | None = None) -> Response:
    """The newest page of the VM's events (polled), or the page older than ``before`` (the
    "Older events" button): a VM's log is never loaded whole."""
    s = await dash.session_for(request, "fragment")
    events = await dash.scheduler.listing.latest_events(
        s.tenant_id, vm_id, before=before, limit=TIMELINE_PAGE + 1
    )
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
        snaps = await dash.scheduler.reads.snapshots(s.tenant_id, vm_id)
    except PalError as exc:
        return dash.message(request, error_words(exc)[1], 200)
    return dash.render(request, "_snapshots.html", snapshots=list(reversed(snaps)))


@router.get("/{vm_id}/metrics.json")
async def metrics(request: Request, dash: Dash, vm_id: str) -> Response:
    s = await dash.session_for(request, "json")
    m = await dash.scheduler.reads.metrics(s.tenant_id, vm_id)
    return JSONResponse(m.model_dump(by_alias=True, mode="json"), headers={"Cache-Control": "no-store"})


@router.post("/{vm_id}/fork")
async def fork(request: Request, dash: Dash, vm_id: str) -> Response:
    s, form = await dash.mutating(request)

    async def act() -> str:
        try:
            count = int(form.get("count") or 1)
        except ValueError:
            raise InvalidRequest("the fork count must be a whole number") from None
        res = await dash.scheduler.forking.fork(s.tenant_id, vm_id, count)
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
        await dash.scheduler.reads.get(s.tenant_id, vm_id)  # 404 for unknown and other tenants' VMs
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
        listing = await dash.scheduler.guest.call(
            s.tenant_id, verbs.LIST_FILES, FilesAt(vm_id=vm_id, path=checked)
        )
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
        at = FileRef(vm_id=vm_id, path=check_workspace_path(path, required=True))
        got = await dash.scheduler.guest.call(s.tenant_id, verbs.READ_FILE, at)
        data, truncated = got.data, got.truncated
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
    at = FileRef(vm_id=vm_id, path=check_workspace_path(path, required=True))
    got = await dash.scheduler.guest.call(s.tenant_id, verbs.READ_FILE, at)
    data, truncated = got.data, got.truncated
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
        res = await dash.scheduler.guest.call(
            s.tenant_id, verbs.WRITE_FILE, FileWrite(vm_id=vm_id, path=target, data=data)
        )
        return f"Uploaded {res.path} ({res.bytes_written} bytes)."

    try:
        return await dash.attempt(request, act, trigger="filesChanged")
    finally:
        if isinstance(upload, UploadFile):
            await upload.close()


@router.post("/{vm_id}/terminal")
async def terminal(request: Request, vm_id: str, dash: Dash) -> Response:
    s, _ = await dash.mutating(request, "json")
    return await open_terminal(request, dash.scheduler.guest, s, vm_id)


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
    call = on_vm(ExecCall, vm_id, req)
    return await sse_exec(lambda: dash.scheduler.guest.exec_stream(s.tenant_id, call))


# Pause, Resume, Delete: a button each, the scheduler's operation, and what to say after it.
Act = Callable[[Scheduler, str, str], Awaitable[str]]


async def _pause(sched: Scheduler, tenant: str, vm_id: str) -> str:
    return f"Paused: snapshot {(await sched.pauses.pause(tenant, vm_id)).vm.snapshot_id}."


async def _resume(sched: Scheduler, tenant: str, vm_id: str) -> str:
    return f"Resumed ({(await sched.pauses.resume(tenant, vm_id)).state})."


async def _delete(sched: Scheduler, tenant: str, vm_id: str) -> str:
    return f"Deleted ({(await sched.deleting.delete(tenant, vm_id)).state})."


def simple_action(act: Act) -> Callable[..., Awaitable[Response]]:
    async def route(request: Request, vm_id: str, dash: Dash) -> Response:
        s, _ = await dash.mutating(request)
        return await dash.attempt(
            request, lambda: act(dash.scheduler, s.tenant_id, vm_id), trigger="vmChanged"
        )

    return route


for name, act in (("pause", _pause), ("resume", _resume), ("delete", _delete)):
    router.add_api_route(f"/{{vm_id}}/{name}", simple_action(act), methods=["POST"], name=name)
