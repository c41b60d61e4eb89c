"""E2B's REST API as an app of its own, mounted on the API server under ``/e2b``
(``E2B_API_URL=http://HOST:8080/e2b``): the calls the SDKs make (docs/e2b.md, the call
table), each translated onto one :class:`ops.SandboxOps` operation.

Authentication: the tenant key in ``X-API-KEY`` (an ``e2b_`` key, or a Pal key with
``E2B_VALIDATE_API_KEY=false``), checked by the :class:`ops.KeyCheck` it is given. Errors:
E2B's ``{"code", "message"}`` with E2B's statuses (errors.py).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pal.errors import InvalidRequest, NotFound, PalError, Unauthorized

from . import ops
from . import rest_models as m
from .errors import json_error, rest_error
from .versions import API_KEY_HEADER, NEXT_TOKEN_HEADER

BUILD_REFUSAL = (
    "building templates through the E2B API is not supported by Pal: build an image with "
    "`pal image build` (docs/images.md) and use its name as the template"
)


@dataclass(frozen=True)
class RestConfig:
    """``domain``: the agent's domain named in answers (``E2B_DOMAIN``'s host form), None
    when clients reach the agent through ``E2B_SANDBOX_URL``."""

    domain: str | None = None


def _error(status: int, message: str) -> Response:
    return json_error(status, message)


def _no_content() -> Response:
    return Response(status_code=204)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def parse_metadata_query(raw: str | None) -> dict[str, str]:
    """``metadata=k%3Dv%26k2%3Dv2``: the SDKs URL-encode each key and value, join them as
    a query string, and send that as one parameter (so it is decoded twice)."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for pair in raw.split("&"):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"metadata filter {pair!r} is not key=value")
        out[urllib.parse.unquote(key)] = urllib.parse.unquote(value)
    return out


def _states(raw: list[str] | None) -> tuple[ops.SandboxState, ...]:
    states: list[ops.SandboxState] = []
    for item in raw or []:
        for state in item.split(","):
            if state == "running":
                states.append("running")
            elif state == "paused":
                states.append("paused")
            elif state:
                raise InvalidRequest(f"unknown sandbox state {state!r} (running, paused)")
    return tuple(states)


def _when(unix: int | None) -> datetime | None:
    return datetime.fromtimestamp(unix, UTC) if unix is not None else None


async def _tenant(request: Request) -> str:
    """The tenant of the request's ``X-API-KEY``; 401 without one."""
    key = request.headers.get(API_KEY_HEADER)
    if not key:
        raise Unauthorized("missing API key: send it in X-API-KEY (E2B_API_KEY)")
    check_key: ops.KeyCheck = request.app.state.check_key
    tenant_id, why = await check_key(key)
    if tenant_id is None:
        raise Unauthorized(why or "invalid API key")
    return tenant_id


Tenant = Annotated[str, Depends(_tenant)]


def create_rest_app(
    sandboxes: ops.SandboxOps,
    check_key: ops.KeyCheck,
    config: RestConfig,
    keys: ops.KeyOps | None = None,
    more: list[APIRouter] | None = None,
) -> FastAPI:
    """``more``: routers of the same surface built elsewhere (volumes.py's)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.check_key = check_key
    _answer_errors(app)
    # One router per group of E2B's calls, in the order their routes were always matched.
    app.include_router(_sandbox_routes(sandboxes, config.domain))
    app.include_router(_lifecycle_routes(sandboxes, config.domain))
    app.include_router(_observation_routes(sandboxes))
    app.include_router(_snapshot_routes(sandboxes))
    app.include_router(_template_routes(sandboxes))
    if keys is not None:
        app.include_router(_key_routes(keys))
    for router in more or []:
        app.include_router(router)
    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error as E2B's ``{"code", "message"}`` with E2B's status (errors.py)."""

    @app.exception_handler(PalError)
    async def _pal_error(_request: Request, exc: PalError) -> Response:
        status, body = rest_error(exc)
        return Response(body, status_code=status, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail))


def _sandbox_routes(sandboxes: ops.SandboxOps, domain: str | None) -> APIRouter:
    """Create, list, read, kill a sandbox; its timeout."""
    r = APIRouter()

    @r.post("/sandboxes")
    async def create(body: m.NewSandbox, t: Tenant) -> Response:
        made = await sandboxes.create(t, body.spec())
        return _json(m.sandbox(made, domain), 201)

    @r.get("/sandboxes")
    async def list_v1(t: Tenant, metadata: str | None = None) -> Response:
        query = ops.SandboxQuery(states=("running",), metadata=parse_metadata_query(metadata))
        items: list[dict[str, Any]] = []
        while True:  # v1 has no pages: all running sandboxes
            page = await sandboxes.list_sandboxes(t, query)
            items.extend(m.listed_sandbox(s) for s in page.items)
            if page.next_token is None:
                return _json(items)
            query = ops.SandboxQuery(states=query.states, metadata=query.metadata, next_token=page.next_token)

    @r.get("/v2/sandboxes")
    async def list_v2(
        t: Tenant,
        metadata: str | None = None,
        state: Annotated[list[str] | None, Query()] = None,
        order: str = "desc",
        started_after: Annotated[datetime | None, Query(alias="startedAfter")] = None,
        template: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 100,
        next_token: Annotated[str | None, Query(alias="nextToken", max_length=1024)] = None,
    ) -> Response:
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be asc or desc")
        page = await sandboxes.list_sandboxes(
            t,
            ops.SandboxQuery(
                states=_states(state),
                metadata=parse_metadata_query(metadata),
                started_after=started_after,
                template=template,
                order="asc" if order == "asc" else "desc",
                limit=limit,
                next_token=next_token or None,
            ),
        )
        headers = {NEXT_TOKEN_HEADER: page.next_token} if page.next_token else None
        return _json([m.listed_sandbox(s) for s in page.items], headers=headers)

    @r.get("/sandboxes/{sandbox_id}")
    async def get(sandbox_id: str, t: Tenant) -> Response:
        return _json(m.sandbox_detail(await sandboxes.get(t, sandbox_id), domain))

    @r.delete("/sandboxes/{sandbox_id}")
    async def kill(sandbox_id: str, t: Tenant) -> Response:
        await sandboxes.kill(t, sandbox_id)
        return _no_content()

    @r.post("/sandboxes/{sandbox_id}/timeout")
    async def set_timeout(sandbox_id: str, body: m.TimeoutRequest, t: Tenant) -> Response:
        await sandboxes.set_timeout(t, sandbox_id, body.timeout)
        return _no_content()

    return r


def _lifecycle_routes(sandboxes: ops.SandboxOps, domain: str | None) -> APIRouter:
    """Keep a sandbox alive, pause it, connect to (resume) it, fork it."""
    r = APIRouter()

    @r.post("/sandboxes/{sandbox_id}/refreshes")
    async def refresh(sandbox_id: str, t: Tenant, body: m.RefreshRequest | None = None) -> Response:
        await sandboxes.connect(t, sandbox_id, body.duration if body else 0)
        return _no_content()

    @r.post("/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str, t: Tenant, body: m.PauseRequest | None = None) -> Response:
        await sandboxes.pause(t, sandbox_id, body.memory if body else True)
        return _no_content()

    @r.post("/sandboxes/{sandbox_id}/connect")
    async def connect(sandbox_id: str, body: m.TimeoutRequest, t: Tenant) -> Response:
        sandbox, resumed = await sandboxes.connect(t, sandbox_id, body.timeout)
        return _json(m.sandbox(sandbox, domain), 201 if resumed else 200)

    @r.post("/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str, body: m.ResumeRequest, t: Tenant) -> Response:
        current = await sandboxes.get(t, sandbox_id)
        if current.state != "paused":  # E2B's deprecated resume takes only a paused one
            return _error(409, f"sandbox {sandbox_id} is already running")
        sandbox, _ = await sandboxes.connect(t, sandbox_id, body.timeout)
        return _json(m.sandbox(sandbox, domain), 201)

    @r.post("/sandboxes/{sandbox_id}/fork")
    async def fork(sandbox_id: str, t: Tenant, body: m.ForkRequest | None = None) -> Response:
        count, timeout = (body.count, body.timeout) if body else (1, 15)
        outcomes = await sandboxes.fork(t, sandbox_id, count, timeout)
        return _json([m.fork_result(o, domain) for o in outcomes], 201)

    return r


def _observation_routes(sandboxes: ops.SandboxOps) -> APIRouter:
    """A sandbox's metrics and logs, and its network policy."""
    r = APIRouter()

    @r.get("/sandboxes/{sandbox_id}/metrics")
    async def metrics(
        sandbox_id: str,
        t: Tenant,
        start: Annotated[int | None, Query(ge=0)] = None,
        end: Annotated[int | None, Query(ge=0)] = None,
    ) -> Response:
        samples = await sandboxes.metrics(t, sandbox_id, _when(start), _when(end))
        return _json([m.metric(s) for s in samples])

    @r.get("/sandboxes/{sandbox_id}/logs")
    async def logs_v1(
        sandbox_id: str,
        t: Tenant,
        start: Annotated[int | None, Query(ge=0)] = None,
        limit: Annotated[int, Query(ge=0, le=1000)] = 1000,
    ) -> Response:
        since = datetime.fromtimestamp(start / 1000, UTC) if start is not None else None
        entries = await sandboxes.logs(t, sandbox_id, since, limit)
        lines = [{"timestamp": m.rfc3339(e.timestamp), "line": e.message} for e in entries]
        return _json({"logs": lines, "logEntries": [m.log_entry(e) for e in entries]})

    @r.get("/v2/sandboxes/{sandbox_id}/logs")
    async def logs_v2(
        sandbox_id: str,
        t: Tenant,
        cursor: Annotated[int | None, Query(ge=0)] = None,
        limit: Annotated[int, Query(ge=0, le=1000)] = 1000,
    ) -> Response:
        since = datetime.fromtimestamp(cursor / 1000, UTC) if cursor is not None else None
        entries = await sandboxes.logs(t, sandbox_id, since, limit)
        return _json({"logs": [m.log_entry(e) for e in entries]})

    @r.put("/sandboxes/{sandbox_id}/network")
    async def network(sandbox_id: str, body: m.NetworkUpdate, t: Tenant) -> Response:
        await sandboxes.update_network(t, sandbox_id, body.policy())
        return _no_content()

    return r


def _snapshot_routes(sandboxes: ops.SandboxOps) -> APIRouter:
    """Named snapshots: take one, list them (a delete is a template's, below)."""
    r = APIRouter()

    @r.post("/sandboxes/{sandbox_id}/snapshots")
    async def create_snapshot(sandbox_id: str, body: m.SnapshotRequest, t: Tenant) -> Response:
        made = await sandboxes.create_snapshot(t, sandbox_id, body.name)
        return _json(m.snapshot(made), 201)

    @r.get("/snapshots")
    async def list_snapshots(
        t: Tenant,
        sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
        name: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 100,
        next_token: Annotated[str | None, Query(alias="nextToken", max_length=1024)] = None,
    ) -> Response:
        page = await sandboxes.list_snapshots(t, sandbox_id, name, limit, next_token or None)
        headers = {NEXT_TOKEN_HEADER: page.next_token} if page.next_token else None
        return _json([m.snapshot(s) for s in page.items], headers=headers)

    return r


def _template_routes(sandboxes: ops.SandboxOps) -> APIRouter:
    """Templates: Pal's images and snapshots as E2B's templates; building one is refused."""
    r = APIRouter()

    @r.delete("/templates/{template_id:path}")
    async def delete_template(template_id: str, t: Tenant) -> Response:
        # The SDKs delete snapshots here (a snapshot is a template to E2B).
        await sandboxes.delete_snapshot(t, template_id)
        return _no_content()

    @r.get("/templates")
    async def templates(t: Tenant) -> Response:
        return _json([m.template(x) for x in await sandboxes.templates(t)])

    @r.get("/templates/aliases/{alias:path}")
    async def template_alias(alias: str, t: Tenant) -> Response:
        for x in await sandboxes.templates(t):
            if alias in x.aliases or alias == x.template_id:
                return _json({"templateID": x.template_id, "public": x.public})
        raise NotFound(f"template {alias!r} not found")

    @r.api_route("/v3/templates", methods=["POST"])
    @r.api_route("/v2/templates", methods=["POST"])
    @r.api_route("/templates", methods=["POST"])
    @r.api_route("/templates/{template_id}", methods=["POST", "PATCH"])
    @r.api_route("/v2/templates/{template_id:path}", methods=["POST", "PATCH"])
    async def build_refused(_t: Tenant) -> Response:
        return _error(501, BUILD_REFUSAL)

    return r


def _api_key(k: ops.ApiKey) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": k.key_id,
        "name": k.name,
        "mask": {
            "prefix": "e2b_",
            "valueLength": 44,
            "maskedValuePrefix": k.mask[:8],
            "maskedValueSuffix": k.mask[-4:],
        },
        "createdAt": m.rfc3339(k.created_at),
        "createdBy": None,
        "lastUsed": None,
    }
    if k.key is not None:
        out["key"] = k.key
    return out


def _key_routes(keys: ops.KeyOps) -> APIRouter:
    """The tenant's E2B keys (E2B's ``/api-keys``): make one (shown once), list, revoke.
    Any of the tenant's keys authenticates these, its Pal key too: `pal e2b env` makes
    its key so."""
    r = APIRouter()

    @r.post("/api-keys")
    async def create_key(t: Tenant, body: m.NewApiKey | None = None) -> Response:
        made = await keys.create_key(t, body.name if body else "")
        return _json(_api_key(made), 201)

    @r.get("/api-keys")
    async def list_keys(t: Tenant) -> Response:
        return _json([_api_key(k) for k in await keys.list_keys(t)])

    @r.delete("/api-keys/{key_id}")
    async def revoke_key(key_id: str, t: Tenant) -> Response:
        await keys.revoke_key(t, key_id)
        return _no_content()

    return r
