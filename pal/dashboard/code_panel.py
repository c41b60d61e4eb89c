"""The VM page's code panel (docs/dashboard.md): run a cell in the VM's kernel and show its
results, images included. Its own routes and partials (_code_panel.html, _code_result.html),
a router of its own (app.py includes it).

Everything a cell returns comes from the guest and is untrusted: text is escaped by the
templates, HTML results are shown in a sandboxed iframe (no scripts, no same origin), and
images only as base64 ``data:`` URLs of the two image types (the page's CSP allows no
other)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from pal.api.code import fold_cell
from pal.cells import CodeRequest
from pal.errors import InvalidRequest, PalError
from pal.wire import verbs
from pal.wire.code import CodeRun
from pal.wire.models import on_vm

from .context import Dash, error_words

router = APIRouter(prefix="/runtime", include_in_schema=False)


def _b64(value: Any) -> str | None:
    """A result's base64 image, if it is valid base64 (a data: URL is built from it)."""
    if not isinstance(value, str):
        return None
    value = "".join(value.split())  # Jupyter wraps base64 at 76 characters
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return value


def view(result: dict[str, Any]) -> dict[str, Any]:
    """One display result as the template shows it."""
    data = result
    svg = data.get("image/svg+xml")
    return {
        "main": bool(data.get("isMainResult")),
        "png": _b64(data.get("image/png")),
        "svg": base64.b64encode(svg.encode()).decode() if isinstance(svg, str) else None,
        "html": data.get("text/html") if isinstance(data.get("text/html"), str) else None,
        "text": data.get("text/plain") if isinstance(data.get("text/plain"), str) else None,
    }


@router.post("/{vm_id}/code")
async def run_cell(request: Request, vm_id: str, dash: Dash) -> Response:
    s, form = await dash.mutating(request)
    lease = None
    try:
        req = CodeRequest.model_validate(
            {"code": str(form.get("code") or ""), "language": str(form.get("language") or "python")}
        )
        if not req.code.strip():
            raise InvalidRequest("type a cell to run")
        # Folded as it comes and counted against the tenant's buffered output, as the API's.
        lease = request.app.state.exec_budget.lease(s.tenant_id)
        cell = on_vm(CodeRun, vm_id, req)
        res = await fold_cell(dash.scheduler.guest.stream(s.tenant_id, verbs.RUN_CODE, cell), lease)
    except ValidationError:
        return dash.message(request, "Invalid request (400): the language is python or bash", 400)
    except PalError as exc:
        status, words = error_words(exc)
        return dash.message(request, words, status)
    finally:
        if lease is not None:
            lease.release()
    return dash.render(request, "_code_result.html", res=res, results=[view(x) for x in res.results])
