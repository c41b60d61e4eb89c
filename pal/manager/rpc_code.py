"""The node RPC's code-context calls (pal/manager/code.py; docs/internals.md's table).

A cell (``POST /vms/{id}/code``) streams NDJSON ``CodeEvent``s; an error after the stream
started is an ``error`` line with its ``status`` (rpc.py's rule for exec), which
``ManagerClient`` raises again.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pal.ids import SafeId
from pal.manager.code import GuestCode
from pal.manager.code_models import CONTEXT_ID_PATTERN, CodeRequest, ContextCreate
from pal.manager.rpc_answers import dump, dump_list, ndjson

router = APIRouter()

ContextId = Annotated[str, Path(pattern=CONTEXT_ID_PATTERN)]


def guest_code(request: Request) -> GuestCode:
    return request.app.state.runtime.code  # type: ignore[no-any-return]


Code = Annotated[GuestCode, Depends(guest_code)]


@router.post("/vms/{vm_id}/code")
async def run_code(vm_id: SafeId, req: CodeRequest, code: Code) -> StreamingResponse:
    code.registry.running(vm_id)  # fail with a status before the stream starts
    return ndjson(code.run(vm_id, req))


@router.post("/vms/{vm_id}/code/contexts")
async def create_context(vm_id: SafeId, req: ContextCreate, code: Code) -> JSONResponse:
    return dump(await code.create_context(vm_id, req))


@router.get("/vms/{vm_id}/code/contexts")
async def list_contexts(vm_id: SafeId, code: Code) -> JSONResponse:
    return dump_list("contexts", await code.list_contexts(vm_id))


@router.delete("/vms/{vm_id}/code/contexts/{ctx}")
async def delete_context(vm_id: SafeId, ctx: ContextId, code: Code) -> JSONResponse:
    await code.delete_context(vm_id, ctx)
    return JSONResponse({"contextId": ctx, "deleted": True})


@router.post("/vms/{vm_id}/code/contexts/{ctx}/interrupt")
async def interrupt_context(vm_id: SafeId, ctx: ContextId, code: Code) -> JSONResponse:
    interrupted = await code.interrupt_context(vm_id, ctx)
    return JSONResponse({"contextId": ctx, "interrupted": interrupted})
