"""The E2B surface bound to Pal: the operations of ops.py as the scheduler's own (each
module here says how), and the keys it takes. ``pal/server.py`` (the composition root)
builds one :class:`E2bBinding` from the scheduler's operation objects and the store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from pal.errors import NotFound
from pal.store import Store, e2b_keys

from . import ops
from .agent_ops import PalAgentInfo, PalInterpreter
from .files import PalFiles
from .keys import is_e2b_key, new_key
from .processes import PalProcesses
from .sandboxes import PalSandboxes


@dataclass(frozen=True)
class TenantKeys:
    """The tenant's E2B keys (pal/store/e2b_keys.py), and the check of a key on the E2B
    surface: an E2B key of the tenant's, or its Pal key (with E2B_VALIDATE_API_KEY=false)."""

    store: Store
    pal_key_check: Any  # pal.api.auth.key_check's shape: (key) -> (tenant id | None, why)

    async def check(self, key: str) -> tuple[str | None, str | None]:
        if is_e2b_key(key):
            tenant = await run_in_threadpool(e2b_keys.tenant_of_key, self.store, key)
            return (tenant, None) if tenant else (None, "invalid E2B API key (revoked, or never made)")
        tenant_id, why = await self.pal_key_check(key)
        return (str(tenant_id), None) if tenant_id is not None else (None, why)

    async def create_key(self, tenant: str, name: str) -> ops.ApiKey:
        key = new_key()
        made = await run_in_threadpool(e2b_keys.add_key, self.store, tenant, key, name)
        return ops.ApiKey(made.key_id, made.name, made.mask, made.created_at, key)

    async def list_keys(self, tenant: str) -> list[ops.ApiKey]:
        rows = await run_in_threadpool(e2b_keys.list_keys, self.store, tenant)
        return [ops.ApiKey(r.key_id, r.name, r.mask, r.created_at) for r in rows]

    async def revoke_key(self, tenant: str, key_id: str) -> None:
        if not await run_in_threadpool(e2b_keys.revoke_key, self.store, tenant, key_id):
            raise NotFound(f"API key {key_id} not found")


@dataclass(frozen=True)
class E2bBinding:
    sandboxes: PalSandboxes
    backend: ops.AgentBackend
    keys: TenantKeys


def bind(sandboxes: PalSandboxes, store: Store, pal_key_check: Any) -> E2bBinding:
    """The agent's side over the same operations as the REST API's ``sandboxes``."""
    guest = sandboxes.guest
    backend = ops.AgentBackend(
        access=sandboxes.access,
        processes=PalProcesses(guest),
        files=PalFiles(guest),
        info=PalAgentInfo(sandboxes.reads),
        interpreter=PalInterpreter(guest),
    )
    return E2bBinding(sandboxes, backend, TenantKeys(store, pal_key_check))
