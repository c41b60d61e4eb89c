"""One tool call, whichever transport: check the arguments against the tool's schema, run
its handler, turn Pal's errors into tool errors a model can act on, and audit the call as an
``mcp_tool`` event on each VM it touched (the tool's name and outcome, never its arguments)."""

from __future__ import annotations

import logging
import re
from typing import Any, Literal
from urllib.parse import quote

import jsonschema
import mcp_types as types

from pal.ids import is_safe_id
from pal.sdk import AsyncClient, PalApiError

from .catalog import SCHEMAS
from .shaping import api_error, error_result
from .tools import HANDLERS

log = logging.getLogger(__name__)

Transport = Literal["stdio", "http"]


def check_arguments(name: str, arguments: dict[str, Any]) -> str | None:
    """Why the arguments do not fit the tool's schema (None: they do)."""
    try:
        jsonschema.validate(arguments, SCHEMAS[name], cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"invalid arguments for {name}: {f'{where}: ' if where else ''}{exc.message}"
    return None


async def call_tool(
    client: AsyncClient, name: str, arguments: dict[str, Any] | None, transport: Transport
) -> types.CallToolResult:
    if name not in HANDLERS:
        return error_result(f"unknown tool {name!r}; the tools are: {', '.join(sorted(HANDLERS))}")
    args = dict(arguments or {})
    why = check_arguments(name, args)
    if why is not None:
        return error_result(f"{why}\nWhat to do: fix the arguments (see the tool's input schema) and retry.")
    try:
        outcome = await HANDLERS[name](client, args)
    except PalApiError as exc:
        vm = args.get("vmId")
        # A VM that is not the caller's (or not there) has no log to write to; the schema
        # checked its id already, and it is checked again before it goes into a path.
        failed_on = isinstance(vm, str) and is_safe_id(vm) and exc.status not in (0, 401, 404)
        vms: tuple[str, ...] = (vm,) if failed_on and isinstance(vm, str) else ()
        await audit(client, name, vms, transport, False, exc)
        return api_error(exc)
    await audit(client, name, outcome.vms, transport, not outcome.result.is_error, None)
    return outcome.result


async def audit(
    client: AsyncClient,
    name: str,
    vms: tuple[str, ...],
    transport: Transport,
    ok: bool,
    exc: PalApiError | None,
) -> None:
    """An ``mcp_tool`` event on each of ``vms``: the tool's (or resource read's) name, the
    transport, the outcome and a failure's status and code; never the arguments."""
    body: dict[str, Any] = {"tool": name, "transport": transport, "ok": ok}
    if exc is not None:
        body.update(status=exc.status, code=re.sub(r"[^A-Z0-9_]", "_", exc.code.upper())[:64] or "ERROR")
    for vm in vms:
        if not is_safe_id(vm):
            continue  # never pasted into a path: the one route an audit calls is its VM's audit
        try:
            await client.request("POST", f"/v1/runtime/vms/{quote(vm, safe='')}/audit", json=body)
        except PalApiError as err:  # the call itself is done: its answer still goes back
            log.warning("could not audit the %s call on %s: %s", name, vm, err)
