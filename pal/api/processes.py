"""The /v1/runtime/vms/{id}/processes routes (docs/processes.md): thin adapters from HTTP
to the process verbs of the node RPC (through the scheduler's guest calls), and exec's
yield mode (``yieldAfterMs``), which is a process started, waited for a while, and read.

Every route is authenticated; another tenant's VM is 404 (the scheduler's rule).
"""

# No `from __future__ import annotations`: FastAPI must resolve the local `Tenant` alias.

import base64
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pal.errors import InvalidRequest
from pal.scheduler.guest import GuestCalls
from pal.spec import ExecRequest, ProcessStartRequest, SignalRequest, Terminal
from pal.wire import verbs
from pal.wire.models import VmRef, on_vm
from pal.wire.processes import (
    MAX_READ_BYTES,
    MAX_STDIN_BYTES,
    MAX_WAIT_MS,
    AttachFrom,
    OutputRead,
    ProcessRef,
    ProcessResize,
    ProcessSignal,
    ProcessStart,
    ProcessWait,
    StdinWrite,
)

from .body import read_bounded, require_json
from .deps import Guest, Tenant
from .errors import error_responses
from .exec_stream import PROCESS_ID_HEADER, TIMEOUT_EXIT_CODE
from .json_response import JSONResponse
from .models import ExecOut
from .process_models import ProcessDeleted, ProcessInfo, ProcessList, StdinWritten
from .process_output import Encoding, TextOutput, read_view, sse_output

YIELD_OUTPUT_MAX = 1024 * 1024  # output bytes a yielded exec answers with (read on from `next`)
MAX_WAIT_SECS = MAX_WAIT_MS // 1000

Pid = Annotated[int, Path(ge=1, le=2**53, description="the process's id (`processId`)")]


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class OutputItem(_Out):
    stream: Literal["stdout", "stderr"]
    data: str = Field(..., description="text (UTF-8; never a cut character), or base64 with `encoding`")


class ProcessOutputOut(_Out):
    from_: int = Field(..., alias="from", description="where this read started")
    next: int = Field(..., description="where the next read starts (after the last byte here)")
    gap: int = Field(..., description="bytes lost to the journal's bound before the first one here")
    output: list[OutputItem]
    process: ProcessInfo
    encoding: Literal["base64"] | None = None


class SignalOut(_Out):
    process_id: int
    signal: str


class ResizeOut(_Out):
    process_id: int
    cols: int
    rows: int


class ProcessStatsOut(_Out):
    process_id: int
    running: bool
    state: str = Field(
        description="the kernel's state letter (R running, S sleeping, D disk wait, T stopped, Z zombie), "
        "or `exited`"
    )
    cpu_user_ms: int | None = Field(description="CPU time in user mode, ms; null once it ended")
    cpu_system_ms: int | None = Field(description="CPU time in the kernel, ms; null once it ended")
    rss_bytes: int | None = Field(description="resident memory, bytes; null once it ended")
    threads: int | None = Field(description="its threads; null once it ended")


def _resume_offset(last_event_id: str | None, start: int) -> int:
    """``Last-Event-ID`` (an SSE client's reconnect) wins over ``?from=``."""
    if last_event_id is None or not last_event_id.strip():
        return start
    try:
        value = int(last_event_id.strip())
    except ValueError:
        raise InvalidRequest("Last-Event-ID must be an output offset (a non-negative integer)") from None
    if value < 0:
        raise InvalidRequest("Last-Event-ID must be an output offset (a non-negative integer)")
    return value


processes_router = APIRouter(
    prefix="/v1/runtime/vms/{vm_id}/processes",
    tags=["processes"],
    responses=error_responses(400, 401, 404, 409, 429, 503),
)


@processes_router.post(
    "",
    status_code=201,
    response_model=ProcessInfo,
    summary="Start a process that outlives the request (output journal, stdin, terminal)",
    dependencies=[Depends(require_json)],
    responses=error_responses(415),
)
async def start_process(tenant: Tenant, guest: Guest, vm_id: str, req: ProcessStartRequest) -> ProcessInfo:
    return ProcessInfo.of(await guest.call(tenant, verbs.START_PROCESS, on_vm(ProcessStart, vm_id, req)))


@processes_router.get(
    "", response_model=ProcessList, summary="The VM's processes, running and recently exited"
)
async def list_processes(tenant: Tenant, guest: Guest, vm_id: str) -> ProcessList:
    return ProcessList.of(await guest.call(tenant, verbs.LIST_PROCESSES, VmRef(vm_id=vm_id)))


@processes_router.get("/{pid}", response_model=ProcessInfo)
async def get_process(tenant: Tenant, guest: Guest, vm_id: str, pid: Pid) -> ProcessInfo:
    return ProcessInfo.of(await guest.call(tenant, verbs.GET_PROCESS, ProcessRef(vm_id=vm_id, pid=pid)))


@processes_router.delete(
    "/{pid}", response_model=ProcessDeleted, summary="Kill the process (its group) and forget it"
)
async def delete_process(tenant: Tenant, guest: Guest, vm_id: str, pid: Pid) -> ProcessDeleted:
    return ProcessDeleted.of(await guest.call(tenant, verbs.DELETE_PROCESS, ProcessRef(vm_id=vm_id, pid=pid)))


@processes_router.get(
    "/{pid}/output",
    response_model=ProcessOutputOut,
    response_model_exclude_none=True,
    summary="Its output from an offset: JSON (long poll with `waitMs`), or SSE with "
    "`Accept: text/event-stream` (event ids are offsets; `Last-Event-ID` resumes)",
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def output(
    tenant: Tenant,
    guest: Guest,
    vm_id: str,
    pid: Pid,
    request: Request,
    start: Annotated[int, Query(alias="from", ge=0, le=2**62)] = 0,
    wait_ms: Annotated[int, Query(alias="waitMs", ge=0, le=MAX_WAIT_MS)] = 0,
    max_bytes: Annotated[int, Query(alias="maxBytes", ge=1, le=MAX_READ_BYTES)] = MAX_READ_BYTES,
    encoding: Encoding = "text",
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> Any:
    if "text/event-stream" in request.headers.get("accept", ""):
        offset = _resume_offset(last_event_id, start)
        at = AttachFrom(vm_id=vm_id, pid=pid, start=offset)
        return await sse_output(lambda: guest.attach(tenant, at), encoding)
    read = OutputRead(vm_id=vm_id, pid=pid, start=start, max_bytes=max_bytes, wait_ms=wait_ms)
    res = await guest.call(tenant, verbs.READ_OUTPUT, read)
    return JSONResponse(read_view(res, encoding))


@processes_router.post(
    "/{pid}/stdin",
    response_model=StdinWritten,
    summary="Write raw bytes to its stdin (`eof=true` closes it after them)",
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string"}}}}},
    responses=error_responses(413),
)
async def write_stdin(
    tenant: Tenant, guest: Guest, vm_id: str, pid: Pid, request: Request, eof: bool = False
) -> StdinWritten:
    data = await read_bounded(request, MAX_STDIN_BYTES)
    written = await guest.call(
        tenant, verbs.WRITE_STDIN, StdinWrite(vm_id=vm_id, pid=pid, data=data, eof=eof)
    )
    return StdinWritten.of(written)


@processes_router.post("/{pid}/stdin/close", response_model=StdinWritten, summary="Close its stdin")
async def close_stdin(tenant: Tenant, guest: Guest, vm_id: str, pid: Pid) -> StdinWritten:
    return StdinWritten.of(
        await guest.call(tenant, verbs.WRITE_STDIN, StdinWrite(vm_id=vm_id, pid=pid, eof=True))
    )


@processes_router.post(
    "/{pid}/signal",
    response_model=SignalOut,
    summary="Send a signal to its process group",
    dependencies=[Depends(require_json)],
)
async def signal(tenant: Tenant, guest: Guest, vm_id: str, pid: Pid, req: SignalRequest) -> SignalOut:
    sent = ProcessSignal(vm_id=vm_id, pid=pid, signal=req.signal)
    await guest.call(tenant, verbs.SIGNAL_PROCESS, sent)
    return SignalOut(process_id=pid, signal=req.signal)


@processes_router.post(
    "/{pid}/resize",
    response_model=ResizeOut,
    summary="Resize its terminal",
    dependencies=[Depends(require_json)],
)
async def resize(tenant: Tenant, guest: Guest, vm_id: str, pid: Pid, req: Terminal) -> ResizeOut:
    await guest.call(
        tenant, verbs.RESIZE_PROCESS, ProcessResize(vm_id=vm_id, pid=pid, cols=req.cols, rows=req.rows)
    )
    return ResizeOut(process_id=pid, cols=req.cols, rows=req.rows)


@processes_router.get(
    "/{pid}/stats",
    response_model=ProcessStatsOut,
    summary="Its CPU time, resident memory, threads and state from the guest's /proc (the process itself)",
)
async def stats(tenant: Tenant, guest: Guest, vm_id: str, pid: Pid) -> ProcessStatsOut:
    got = await guest.call(tenant, verbs.PROCESS_STATS, ProcessRef(vm_id=vm_id, pid=pid))
    return ProcessStatsOut(process_id=got.pid, **got.model_dump(exclude={"pid"}))


@processes_router.post("/{pid}/wait", response_model=ProcessInfo, summary="Wait for it to exit (long poll)")
async def wait(
    tenant: Tenant,
    guest: Guest,
    vm_id: str,
    pid: Pid,
    timeout_secs: Annotated[float, Query(alias="timeoutSecs", ge=0, le=MAX_WAIT_SECS)] = 30,
) -> ProcessInfo:
    waited = ProcessWait(vm_id=vm_id, pid=pid, timeout_ms=int(timeout_secs * 1000))
    return ProcessInfo.of(await guest.call(tenant, verbs.WAIT_PROCESS, waited))


async def yield_exec(guest: GuestCalls, tenant: str, vm_id: str, req: ExecRequest) -> JSONResponse:
    """``yieldAfterMs``: the whole result when the command ends within it; else
    ``{processId, running: true, stdout, stderr, next}`` (the output so far, at most
    YIELD_OUTPUT_MAX bytes) with the command still running."""
    start = ProcessStart.model_validate({**req.model_dump(exclude={"yield_after_ms"}), "vm_id": vm_id})
    proc = await guest.call(tenant, verbs.START_PROCESS, start)
    pid = proc.process_id
    waited = ProcessWait(vm_id=vm_id, pid=pid, timeout_ms=req.yield_after_ms or 0)
    info = await guest.call(tenant, verbs.WAIT_PROCESS, waited)
    text = TextOutput()
    parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
    nxt, taken = 0, 0
    while True:
        read = OutputRead(
            vm_id=vm_id, pid=pid, start=nxt, max_bytes=min(MAX_READ_BYTES, YIELD_OUTPUT_MAX - taken)
        )
        res = await guest.call(tenant, verbs.READ_OUTPUT, read)
        for chunk in res.chunks:
            data = base64.b64decode(chunk.data)
            taken += len(data)
            for stream, piece, _end in text.feed(chunk.stream, chunk.offset + len(data), data):
                parts[stream].append(piece)
        nxt, info = res.next, res.process
        if nxt >= info.journal.end or taken >= YIELD_OUTPUT_MAX or not res.chunks:
            break
    done, complete = not info.running, nxt >= info.journal.end
    if done and complete:
        for stream, piece, _end in text.flush():
            parts[stream].append(piece)
    code = TIMEOUT_EXIT_CODE if info.timed_out else info.exit_code  # as a buffered exec answers
    out = ExecOut(
        exit_code=code if done else None,
        stdout="".join(parts["stdout"]),
        stderr="".join(parts["stderr"]),
        process_id=pid,
        timed_out=True if done and info.timed_out else None,
        running=None if done else True,
        next=None if done and complete else (text.offset if text.offset is not None else nxt),
        truncated=True if done and not complete else None,
    )
    body = out.model_dump(mode="json", by_alias=True, exclude_none=True)
    return JSONResponse(body, headers={PROCESS_ID_HEADER: str(pid)})
