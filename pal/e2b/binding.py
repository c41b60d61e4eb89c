"""The E2B surface bound to Pal: the operations of ops.py as the scheduler's own (each
module here says how), and the keys it takes. ``pal/server.py`` (the composition root)
builds one :class:`E2bBinding` from the scheduler's operation objects and the store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from pal.errors import NotFound
from pal.scheduler.delete import Deleting
from pal.scheduler.egress_secrets import EgressAndSecrets
from pal.scheduler.fork import Forking
from pal.scheduler.guest import GuestCalls
from pal.scheduler.lifetime import Lifetimes
from pal.scheduler.listing import Listing
from pal.scheduler.pause_resume import PauseResume
from pal.scheduler.reads import Reads
from pal.scheduler.schedule import Scheduling
from pal.store import Store, e2b_keys

from . import ops
from .agent_ops import PalAgentInfo, PalInterpreter
from .files import PalFiles
from .keys import is_e2b_key, new_key
from .processes import PalProcesses
from .sandboxes import PalSandboxes


@dataclass(frozen=True)
class Operations:
    """The scheduler's operations the E2B surface calls (the composition root's objects)."""

    scheduling: Scheduling
    reads: Reads
    listing: Listing
    deleting: Deleting
    lifetimes: Lifetimes
    pauses: PauseResume
    forking: Forking
    egress: EgressAndSecrets
    guest: GuestCalls


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


def bind(o: Operations, store: Store, secret: bytes, pal_key_check: Any) -> E2bBinding:
    sandboxes = PalSandboxes(
        o.scheduling,
        o.reads,
        o.listing,
        o.deleting,
        o.lifetimes,
        o.pauses,
        o.forking,
        o.egress,
        o.guest,
        secret,
    )
    backend = ops.AgentBackend(
        access=sandboxes.access,
        processes=PalProcesses(o.guest),
        files=PalFiles(o.guest),
        info=PalAgentInfo(o.reads),
        interpreter=PalInterpreter(o.guest),
    )
    return E2bBinding(sandboxes, backend, TenantKeys(store, pal_key_check))
