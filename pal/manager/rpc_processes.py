"""The node RPC's process calls (pal/manager/processes.py; docs/internals.md's table).

Module-level handlers on :data:`router`, which ``rpc.create_rpc_app`` serves with the
others. The output stream (``attach``) is NDJSON of ``ProcessEvent``s; an error after it
started is an ``error`` event with its ``status`` (rpc.py's rule for exec), which
``ManagerClient`` raises again.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pal.errors import TooLarge
from pal.ids import SafeId
from pal.manager.processes import MAX_READ_BYTES, MAX_STDIN_BYTES, MAX_WAIT_MS, GuestProcesses
from pal.manager.rpc_answers import dump, dump_list, ndjson
from pal.spec import ProcessStartRequest, SignalRequest, Terminal

router = APIRouter()

Pid = Annotated[int, Path(ge=1, le=2**53)]
Offset = Annotated[int, Query(alias="from", ge=0, le=2**62)]


def guest_processes(request: Request) -> GuestProcesses:
    return request.app.state.runtime.processes  # type: ignore[no-any-return]


Processes = Annotated[GuestProcesses, Depends(guest_processes)]


@router.post("/vms/{vm_id}/processes")
async def start_process(vm_id: SafeId, req: ProcessStartRequest, procs: Processes) -> JSONResponse:
    return dump(await procs.start(vm_id, req))


@router.get("/vms/{vm_id}/processes")
async def list_processes(vm_id: SafeId, procs: Processes) -> JSONResponse:
    return dump_list("processes", await procs.list(vm_id))


@router.get("/vms/{vm_id}/processes/{pid}")
async def get_process(vm_id: SafeId, pid: Pid, procs: Processes) -> JSONResponse:
    return dump(await procs.get(vm_id, pid))


@router.delete("/vms/{vm_id}/processes/{pid}")
async def delete_process(vm_id: SafeId, pid: Pid, procs: Processes) -> JSONResponse:
    return dump(await procs.delete(vm_id, pid))


@router.get("/vms/{vm_id}/processes/{pid}/output")
async def read_output(
    vm_id: SafeId,
    pid: Pid,
    start: Offset,
    procs: Processes,
    max_bytes: Annotated[int, Query(alias="maxBytes", ge=1, le=MAX_READ_BYTES)] = MAX_READ_BYTES,
    wait_ms: Annotated[int, Query(alias="waitMs", ge=0, le=MAX_WAIT_MS)] = 0,
) -> JSONResponse:
    return dump(await procs.read(vm_id, pid, start, max_bytes, wait_ms))


@router.get("/vms/{vm_id}/processes/{pid}/attach")
async def attach(vm_id: SafeId, pid: Pid, start: Offset, procs: Processes) -> StreamingResponse:
    procs.registry.running(vm_id)  # fail with a status before the stream starts
    return ndjson(procs.attach(vm_id, pid, start))


@router.post("/vms/{vm_id}/processes/{pid}/stdin")
async def write_stdin(
    vm_id: SafeId, pid: Pid, request: Request, procs: Processes, eof: bool = False
) -> JSONResponse:
    data = await request.body()
    if len(data) > MAX_STDIN_BYTES:
        raise TooLarge(f"a stdin write takes at most {MAX_STDIN_BYTES} bytes")
    return dump(await procs.write_stdin(vm_id, pid, data, eof))


@router.post("/vms/{vm_id}/processes/{pid}/signal")
async def signal(vm_id: SafeId, pid: Pid, req: SignalRequest, procs: Processes) -> JSONResponse:
    await procs.signal(vm_id, pid, req)
    return JSONResponse({"processId": pid, "signal": req.signal})


@router.post("/vms/{vm_id}/processes/{pid}/resize")
async def resize(vm_id: SafeId, pid: Pid, req: Terminal, procs: Processes) -> JSONResponse:
    await procs.resize(vm_id, pid, req)
    return JSONResponse({"processId": pid, "cols": req.cols, "rows": req.rows})


@router.post("/vms/{vm_id}/processes/{pid}/wait")
async def wait(
    vm_id: SafeId,
    pid: Pid,
    procs: Processes,
    timeout_ms: Annotated[int, Query(alias="timeoutMs", ge=0, le=MAX_WAIT_MS)] = 0,
) -> JSONResponse:
    return dump(await procs.wait(vm_id, pid, timeout_ms))
