"""Tenant authentication: `Authorization: Bearer <apiKey>` on every /v1 route.

The store keeps only a hash of each key; `tenant_by_api_key` does the lookup. The tenant id
it yields is what every scheduler call is scoped by, so other tenants' VMs are 404.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pal.errors import Unauthorized

# auto_error=False: we raise our own 401 (FastAPI's default is a 403 with another body).
bearer = HTTPBearer(auto_error=False, description="tenant API key from `pal tenants create`")


async def tenant_for_key(store: Any, api_key: str) -> Any | None:
    """The tenant owning ``api_key``; works with a sync or an async store.

    A sync (SQLite) lookup runs in a worker thread: it may wait on another writer's lock
    and must not stall the event loop that streams exec output meanwhile.
    """
    lookup = store.tenant_by_api_key
    if inspect.iscoroutinefunction(lookup):
        return await lookup(api_key)
    return await run_in_threadpool(lookup, api_key)


async def tenant_for_key_hash(store: Any, key_hash: str) -> Any | None:
    """:func:`tenant_for_key` of the key whose hash is ``key_hash``."""
    lookup = store.tenant_by_api_key_hash
    if inspect.iscoroutinefunction(lookup):
        return await lookup(key_hash)
    return await run_in_threadpool(lookup, key_hash)


async def require_tenant(
    request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)
) -> str:
    """The id of the tenant whose API key the request carries (looked up in the app's store,
    ``app.state.store``); 401 without a valid one."""
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <apiKey>' (the SDKs and the CLI "
            "send PAL_API_KEY; a key comes from `pal tenants create`)"
        )
    store = request.app.state.store
    tenant = await tenant_for_key(store, creds.credentials)
    if tenant is None:
        raise Unauthorized(await why_refused(store, creds.credentials))
    request.state.tenant = tenant
    return str(tenant.id)


async def why_refused(store: Any, api_key: str) -> str:
    """Why ``api_key`` is no tenant's: expired, rotated out, tenant being deleted, or
    unknown, said plainly (never which tenant an unknown key might have belonged to)."""
    why = getattr(store, "why_key_refused", None)
    return await run_in_threadpool(why, api_key) if why is not None else "invalid API key"


async def key_check(store: Any, api_key: str) -> tuple[str | None, str | None]:
    """``(tenant id, None)`` when ``api_key`` is a tenant's, else ``(None, why not)``: the
    MCP endpoint's check."""
    tenant = await tenant_for_key(store, api_key)
    if tenant is not None:
        return str(tenant.id), None
    return None, await why_refused(store, api_key)
