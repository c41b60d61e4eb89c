"""The /v1/runtime/vms/{id}/code routes (issue 26; docs/agents.md "Code interpreter"): run a
cell in a stateful kernel (buffered JSON, or SSE with ``Accept: text/event-stream``), and
manage the VM's code contexts.

Like exec (exec_stream.py): a refusal before the cell runs keeps its status (404 VM or
context, 409 not running / no kernel in the image / a cell already running, 429 too many
contexts, 400 bad input); a timeout is not an error status: the cell is interrupted, the
answer carries ``timedOut: true`` with the output so far, and the context stays usable.
"""

# No `from __future__ import annotations`: FastAPI must resolve the local `Tenant` alias.

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import StreamingResponse

from pal.cells import CodeRequest, ContextCreate
from pal.errors import Unavailable
from pal.wire import verbs
from pal.wire.code import CONTEXT_ID_PATTERN, CodeEvent, CodeRun, ContextNew, ContextRef
from pal.wire.models import VmRef, on_vm

from .body import require_json
from .code_models import CodeContext, CodeError, CodeResult, ContextDeleted, ContextInterrupted, ContextList
from .deps import Guest, Tenant
from .errors import error_responses
from .exec_budget import ExecBudget, Lease, LeasedJSON
from .exec_stream import pumped_sse, sse_frame
from .json_response import JSONResponse

ContextId = Annotated[str, Path(pattern=CONTEXT_ID_PATTERN, description="a context's id")]


code_router = APIRouter(
    prefix="/v1/runtime/vms/{vm_id}/code",
    tags=["code"],
    responses=error_responses(400, 401, 404, 409, 429, 503),
)


class CellFold:
    """A cell's events folded into its buffered answer as they arrive (never kept as a list
    of events), every kind counted against the tenant's budget of buffered output
    (exec_budget.py): stream text, display results and errors alike. What the budget has
    no room for is not kept, and the answer says ``truncated``."""

    def __init__(self, lease: Lease | None = None) -> None:
        self.lease = lease
        self.out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.results: list[dict[str, Any]] = []
        self.error: CodeError | None = None
        self.end: CodeEvent | None = None
        self.cut = False

    def _room(self, n: int) -> int:
        if self.lease is None or n == 0:
            return n
        granted = self.lease.take(n)
        if granted < n:
            self.cut = True
        return granted

    def add(self, ev: CodeEvent) -> bool:
        """Fold one event in; True once the cell ended (``end``)."""
        if ev.type in ("stdout", "stderr"):
            text = ev.text or ""
            self.out[ev.type].append(text[: self._room(len(text))])
        elif ev.type == "result":
            result = {**(ev.data or {}), "isMainResult": bool(ev.is_main_result)}
            size = len(json.dumps(result))
            if self._room(size) == size:
                self.results.append(result)
        elif ev.type == "error" and ev.error is not None:
            e = ev.error
            size = len(e.name) + len(e.value) + sum(len(x) for x in e.traceback)
            if self._room(size) == size:
                self.error = CodeError.of(e)  # the cell's exception: the last one
        elif ev.type == "end":
            self.end = ev
            return True
        return False

    def result(self) -> CodeResult:
        assert self.end is not None
        main = next((r for r in self.results if r["isMainResult"]), None)
        text = main.get("text/plain") if main else None
        return CodeResult(
            context_id=self.end.context_id or "",
            execution_count=self.end.execution_count,
            stdout="".join(self.out["stdout"]),
            stderr="".join(self.out["stderr"]),
            results=self.results,
            text=text if isinstance(text, str) else None,
            error=self.error,
            timed_out=bool(self.end.timed_out),
            truncated=self.cut or None,
        )


async def fold_cell(events: AsyncIterator[CodeEvent], lease: Lease | None = None) -> CodeResult:
    """A cell's buffered answer (CellFold); its events' iterator is closed either way."""
    fold = CellFold(lease)
    try:
        async for ev in events:
            if fold.add(ev):
                return fold.result()
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
    raise Unavailable("the cell ended without its result", code="GUEST_ERROR")


async def budgeted_cell(budget: ExecBudget, tenant: str, events: AsyncIterator[CodeEvent]) -> LeasedJSON:
    """A buffered cell under ``tenant``'s budget of buffered output: 429 before it runs when
    the budget is all held; what it holds is counted until the answer is sent."""
    lease = budget.lease(tenant)
    try:
        res = await fold_cell(events, lease)
    except BaseException:
        lease.release()
        raise
    body = res.model_dump(mode="json", by_alias=True)
    if body.get("truncated") is None:
        body.pop("truncated", None)  # absent unless it was cut
    return LeasedJSON(body, lease)


def _frame(ev: CodeEvent) -> bytes:
    body = ev.model_dump(mode="json", by_alias=True, exclude_none=True)
    body.pop("type", None)
    return sse_frame(ev.type, body)


async def _sse(open_events: Any) -> StreamingResponse | JSONResponse:
    """Events as SSE (``stdout``/``stderr``/``result``/``error``/``end``); a refusal within
    FIRST_EVENT_GRACE_S keeps its status, a later one is an ``error`` event with the
    error shape (exec_stream.sse_exec's rule)."""
    return await pumped_sse(
        open_events,
        "code",
        frame=_frame,
        ends=lambda ev: ev.type == "end",
        done_frame=sse_frame(
            "error", {"code": "GUEST_ERROR", "message": "the cell ended without its result"}
        ),
    )


@code_router.post(
    "",
    response_model=CodeResult,
    summary="Run a cell in a stateful kernel (Python: Jupyter; bash); "
    "`Accept: text/event-stream` streams stdout/stderr/result/error/end events",
    dependencies=[Depends(require_json)],
    responses={200: {"content": {"text/event-stream": {}}}, **error_responses(415)},
)
async def run_code(tenant: Tenant, guest: Guest, vm_id: str, req: CodeRequest, request: Request) -> Any:
    cell = on_vm(CodeRun, vm_id, req)
    if "text/event-stream" in request.headers.get("accept", ""):
        return await _sse(lambda: guest.stream(tenant, verbs.RUN_CODE, cell))
    return await budgeted_cell(
        request.app.state.exec_budget, tenant, guest.stream(tenant, verbs.RUN_CODE, cell)
    )


@code_router.post(
    "/contexts",
    status_code=201,
    response_model=CodeContext,
    summary="Start a new context (its own kernel), with an optional cwd and env",
    dependencies=[Depends(require_json)],
    responses=error_responses(415),
)
async def create_context(tenant: Tenant, guest: Guest, vm_id: str, req: ContextCreate) -> CodeContext:
    return CodeContext.of(await guest.call(tenant, verbs.CREATE_CONTEXT, on_vm(ContextNew, vm_id, req)))


@code_router.get("/contexts", response_model=ContextList, summary="The VM's code contexts")
async def list_contexts(tenant: Tenant, guest: Guest, vm_id: str) -> ContextList:
    return ContextList.of(await guest.call(tenant, verbs.LIST_CONTEXTS, VmRef(vm_id=vm_id)))


@code_router.delete("/contexts/{ctx}", response_model=ContextDeleted, summary="Stop a context's kernel")
async def delete_context(tenant: Tenant, guest: Guest, vm_id: str, ctx: ContextId) -> ContextDeleted:
    return ContextDeleted.of(
        await guest.call(tenant, verbs.DELETE_CONTEXT, ContextRef(vm_id=vm_id, context_id=ctx))
    )


@code_router.post(
    "/contexts/{ctx}/interrupt",
    response_model=ContextInterrupted,
    summary="Interrupt the cell running in a context (KeyboardInterrupt; the context stays)",
)
async def interrupt_context(tenant: Tenant, guest: Guest, vm_id: str, ctx: ContextId) -> ContextInterrupted:
    interrupted = await guest.call(tenant, verbs.INTERRUPT_CONTEXT, ContextRef(vm_id=vm_id, context_id=ctx))
    return ContextInterrupted.of(interrupted)
