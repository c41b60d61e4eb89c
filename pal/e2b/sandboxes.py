"""E2B's control plane (:class:`ops.SandboxOps`) over the scheduler's operations: each call
of the REST API is one of them (schedule, pause/resume, fork, delete, lifetimes, egress,
the reads), with the tenant the caller's key named; nothing here keeps state.

- A sandbox is one of the tenant's VMs; E2B's ``running`` is any VM that answers requests
  (running, or suspended by Pal itself: it wakes on the next one), ``paused`` one paused
  by a ``pause`` (or its lifetime's end). Terminated and failed VMs are gone (404).
- ``timeout`` is Pal's lifetime, counted from now; at its end the sandbox is deleted, or
  paused when ``autoPause``.
- A template is an image the tenant may use; ``base`` is Pal's ``default`` image, which a
  sandbox made here sets up with E2B's conventions (conventions.py).
- A snapshot is one of Pal's kept snapshots (pal/scheduler/kept.py): a create whose
  template is one of the tenant's (by id or name) starts a sandbox from it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pal.errors import Conflict, InvalidRequest, NotFound, PalError, VolumeNotFound
from pal.scheduler.delete import Deleting
from pal.scheduler.egress_secrets import EgressAndSecrets
from pal.scheduler.fork import Forking
from pal.scheduler.guest import GuestCalls
from pal.scheduler.kept import KeptSnapshots
from pal.scheduler.lifetime import Lifetimes
from pal.scheduler.listing import Listing
from pal.scheduler.pause_resume import PauseResume
from pal.scheduler.reads import Reads
from pal.scheduler.schedule import Scheduling
from pal.scheduler.states import AUTO_LIVE_MARKERS
from pal.spec import MAX_LIFETIME_SECS, AgentSpec, EgressUpdate, LifetimeUpdate, PauseRequest
from pal.store import VmRecord
from pal.store.kept import KeptSnapshot
from pal.wire import verbs
from pal.wire.models import WorkloadUserName

from . import conventions as conv
from . import ops

PAGE = 200  # VMs read from the store at a time while a list filters them
GONE = ("terminated", "failed")
# E2B's template names Pal answers for its default image.
DEFAULT_ALIASES = {"base": "default", "code-interpreter-v1": "code-interpreter"}
# What a template's sandboxes need beyond Pal's default size (a Jupyter kernel's memory).
TEMPLATE_LIMITS: dict[str, dict[str, int]] = {"code-interpreter": {"memoryMib": 512}}
MIB = 1 << 20
MAX_IDLE_SECS = 7 * 24 * 3600  # AgentSpec.idle_timeout_secs's bound


def _egress(network: ops.NetworkPolicy) -> object | None:
    """E2B's network options as Pal's egress policy (None: the server's default)."""
    deny_all = not network.allow_internet or "0.0.0.0/0" in network.deny_out
    if deny_all:
        return {"allow": list(network.allow_out)} if network.allow_out else "none"
    if network.deny_out:
        return {"deny": list(network.deny_out)}
    return None


def _token(created_at: datetime, vm_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), vm_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _untoken(token: str) -> tuple[str, str]:
    try:
        at, vm_id = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return str(at), str(vm_id)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidRequest("nextToken is not one this server gave") from None


def _tags(spec: ops.CreateSandbox, template: str) -> dict[str, str]:
    """A created sandbox's metadata: the create's own (E2B's reserved keys dropped from it)
    and the surface's reserved keys (conventions.py): its template, whether it is open."""
    reserved = {conv.TEMPLATE_KEY: template} | ({} if spec.secure else {conv.OPEN_KEY: "true"})
    user_meta = {k: v for k, v in spec.metadata.items() if not k.startswith(conv.RESERVED_PREFIX)}
    return {**user_meta, **reserved}


@dataclass(frozen=True)
class PalSandboxes:
    """The operations the REST API calls, bound to the scheduler's (built once, in
    pal/server.py, from the scheduler's operation objects)."""

    scheduling: Scheduling
    reads: Reads
    listing: Listing
    deleting: Deleting
    lifetimes: Lifetimes
    pauses: PauseResume
    forking: Forking
    egress: EgressAndSecrets
    guest: GuestCalls
    kept: KeptSnapshots
    secret: bytes  # the access tokens' key (conventions.access_token)
    idle_timeout_s: int = 0  # PAL_E2B_IDLE_TIMEOUT: Pal's idle suspend for E2B's sandboxes
    now: Callable[[], datetime] = lambda: datetime.now(UTC)

    # -- views ------------------------------------------------------------------------------

    def state_of(self, vm: VmRecord) -> ops.SandboxState:
        if vm.state == "paused" and vm.marker not in AUTO_LIVE_MARKERS and vm.paused_by != "idle":
            return "paused"
        return "running"

    def view(self, vm: VmRecord, mounts: list[tuple[str, str, bool]] | None = None) -> ops.Sandbox:
        """E2B's view of ``vm``; ``mounts`` (Reads.mounts) for the views that show them."""
        limits = vm.limits or {}
        end = vm.lifetime_ends_at or (self.now() + timedelta(seconds=MAX_LIFETIME_SECS))
        template = vm.metadata.get(conv.TEMPLATE_KEY, vm.image)
        return ops.Sandbox(
            sandbox_id=vm.vm_id,
            template_id=template,
            alias=template,
            state=self.state_of(vm),
            started_at=vm.created_at,
            end_at=end,
            cpu_count=int(limits.get("vcpus") or 1),
            memory_mb=int(limits.get("memoryMib") or limits.get("memory_mib") or 0),
            disk_size_mb=int(limits.get("diskMib") or limits.get("disk_mib") or 0),
            metadata=conv.public_metadata(vm.metadata),
            access_token=conv.access_token(self.secret, vm.vm_id) if conv.is_secure(vm.metadata) else None,
            auto_pause=vm.on_lifetime_end == "pause",
            allow_internet=vm.egress != "none",
            volume_mounts=tuple(ops.VolumeMount(name, path) for name, path, _ in mounts or ()),
        )

    async def _own(self, tenant: str, sandbox_id: str) -> VmRecord:
        vm = await self.reads.get(tenant, sandbox_id)
        if vm.state in GONE:
            raise NotFound(f"sandbox {sandbox_id} not found")
        return vm

    # -- SandboxOps --------------------------------------------------------------------------

    async def _image(self, tenant: str, template: str) -> str:
        names = {i.name for i in await self.reads.list_images(tenant)}
        if template in names:
            return template
        if template in DEFAULT_ALIASES and DEFAULT_ALIASES[template] in names:
            return DEFAULT_ALIASES[template]
        raise NotFound(
            f"template {template!r} not found (`pal image ls` lists the images; 'base' is Pal's default)"
        )

    async def create(self, tenant: str, spec: ops.CreateSandbox) -> ops.Sandbox:
        if (started := await self._from_snapshot(tenant, spec)) is not None:
            return started
        image = await self._image(tenant, spec.template)
        try:
            agent = AgentSpec.model_validate(
                {
                    "image": image,
                    "limits": TEMPLATE_LIMITS.get(image, {}),
                    "metadata": _tags(spec, spec.template),
                    "secrets": dict(spec.env_vars),
                    "lifetimeSecs": min(max(spec.timeout_s, 1), MAX_LIFETIME_SECS),
                    "onLifetimeEnd": "pause" if spec.auto_pause else "delete",
                    "egress": _egress(spec.network),
                    "idleTimeoutSecs": min(self.idle_timeout_s, MAX_IDLE_SECS),
                    "volumes": [{"name": m.name, "path": m.path} for m in spec.volume_mounts],
                }
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc).splitlines()[0] if str(exc) else "invalid sandbox") from None
        try:
            vm, _method = await self.scheduling.schedule(tenant, agent)
        except VolumeNotFound as exc:
            raise InvalidRequest(exc.message) from None  # E2B's answer for a missing volume
        try:
            await self._setup(tenant, vm.vm_id)
        except BaseException:
            await self.deleting.delete(tenant, vm.vm_id)
            raise
        return self.view(vm)

    async def _setup(self, tenant: str, vm_id: str) -> None:
        """E2B's user and home (conventions.py) before the sandbox is handed out: one guest
        request, no process (the harness renames uid 1000 and bind-mounts its home)."""
        req = WorkloadUserName(vm_id=vm_id, name=conv.DEFAULT_USER, home=conv.HOMES[conv.DEFAULT_USER])
        try:
            await self.guest.call(tenant, verbs.RENAME_USER, req)
        except PalError as exc:
            raise PalError(f"setting the sandbox up failed: {exc.message}") from None

    async def get(self, tenant: str, sandbox_id: str) -> ops.Sandbox:
        vm = await self._own(tenant, sandbox_id)
        return self.view(vm, (await self.reads.mounts([vm.vm_id])).get(vm.vm_id))

    async def list_sandboxes(self, tenant: str, query: ops.SandboxQuery) -> ops.Page[ops.Sandbox]:
        """Every listed VM of the tenant that matches, in E2B's order, a page after the
        token's VM (the filters run here, over the store's pages)."""
        rows: list[VmRecord] = []
        after: tuple[datetime, str] | None = None
        while True:
            page = await self.listing.vms(tenant, after=after, limit=PAGE, metadata=dict(query.metadata))
            rows += [v for v in page if self._matches(v, query)]
            if len(page) < PAGE:
                break
            after = (page[-1].created_at, page[-1].vm_id)
        rows.sort(key=lambda v: (v.created_at, v.vm_id), reverse=query.order == "desc")
        if query.next_token:
            at, vm_id = _untoken(query.next_token)
            try:
                key = (datetime.fromisoformat(at), vm_id)
            except ValueError:
                raise InvalidRequest("nextToken is not one this server gave") from None
            if query.order == "desc":
                rows = [v for v in rows if (v.created_at, v.vm_id) < key]
            else:
                rows = [v for v in rows if (v.created_at, v.vm_id) > key]
        chosen = rows[: query.limit]
        more = len(rows) > query.limit
        token = _token(chosen[-1].created_at, chosen[-1].vm_id) if more and chosen else None
        mounts = await self.reads.mounts([v.vm_id for v in chosen])
        return ops.Page([self.view(v, mounts.get(v.vm_id)) for v in chosen], token)

    def _matches(self, vm: VmRecord, query: ops.SandboxQuery) -> bool:
        if vm.state in GONE:
            return False
        if query.states and self.state_of(vm) not in query.states:
            return False
        if query.started_after is not None and vm.created_at <= query.started_after:
            return False
        template = vm.metadata.get(conv.TEMPLATE_KEY, vm.image)
        return query.template is None or query.template in (template, vm.image)

    async def kill(self, tenant: str, sandbox_id: str) -> None:
        await self._own(tenant, sandbox_id)
        await self.deleting.delete(tenant, sandbox_id)

    async def _end_in(self, tenant: str, vm: VmRecord, timeout_s: int, on_end: str | None = None) -> VmRecord:
        """The sandbox's lifetime ends ``timeout_s`` from now (and then ``on_end``: pause or
        delete; None: as it was)."""
        since = (self.now() - vm.created_at).total_seconds()
        secs = min(math.ceil(since) + max(timeout_s, 1), MAX_LIFETIME_SECS)
        update = {"lifetimeSecs": secs} | ({} if on_end is None else {"onLifetimeEnd": on_end})
        return await self.lifetimes.set_lifetime(tenant, vm.vm_id, LifetimeUpdate.model_validate(update))

    async def set_timeout(self, tenant: str, sandbox_id: str, timeout_s: int) -> None:
        await self._end_in(tenant, await self._own(tenant, sandbox_id), timeout_s)

    async def pause(self, tenant: str, sandbox_id: str, keep_memory: bool) -> None:
        vm = await self._own(tenant, sandbox_id)
        if self.state_of(vm) == "paused":
            raise Conflict(f"sandbox {sandbox_id} is already paused")
        await self.pauses.pause(tenant, sandbox_id, PauseRequest.model_validate({}))

    async def connect(self, tenant: str, sandbox_id: str, timeout_s: int) -> tuple[ops.Sandbox, bool]:
        vm = await self._own(tenant, sandbox_id)
        resumed = vm.state == "paused"
        if resumed:
            vm = await self.pauses.resume(tenant, sandbox_id)
        wanted = self.now() + timedelta(seconds=max(timeout_s, 0))
        if timeout_s > 0 and vm.lifetime_ends_at is not None and vm.lifetime_ends_at < wanted:
            vm = await self._end_in(tenant, vm, timeout_s)
        return self.view(vm), resumed and self.state_of(vm) == "running"

    async def fork(self, tenant: str, sandbox_id: str, count: int, timeout_s: int) -> list[ops.ForkOutcome]:
        await self._own(tenant, sandbox_id)
        result = await self.forking.fork(tenant, sandbox_id, count)
        out: list[ops.ForkOutcome] = []
        for child in result.forks:
            if child.error:
                out.append(ops.ForkOutcome(error_status=500, error_message=child.error))
                continue
            vm = await self.reads.get(tenant, child.vm_id)
            if timeout_s > 0:
                vm = await self._end_in(tenant, vm, timeout_s)
            out.append(ops.ForkOutcome(sandbox=self.view(vm)))
        return out

    async def metrics(
        self, tenant: str, sandbox_id: str, start: datetime | None, end: datetime | None
    ) -> list[ops.MetricSample]:
        vm = await self._own(tenant, sandbox_id)
        got = await self.reads.metrics(tenant, sandbox_id)
        cpus = int((vm.limits or {}).get("vcpus") or 1)
        mem_total = int((vm.limits or {}).get("memoryMib") or 0) * MIB
        out = []
        for s in got.samples:
            at = datetime.fromtimestamp(s.t / 1000, UTC)
            if (start is not None and at < start) or (end is not None and at > end):
                continue
            out.append(
                ops.MetricSample(
                    timestamp=at,
                    cpu_count=cpus,
                    cpu_used_pct=round((s.cpu_pct or 0.0) / cpus, 2),
                    mem_used=s.guest_mem_used_bytes or s.rss_bytes or 0,
                    mem_total=s.guest_mem_total_bytes or mem_total,
                    mem_cache=0,
                    disk_used=s.disk_used_bytes or 0,
                    disk_total=s.disk_total_bytes or 0,
                )
            )
        return out

    async def logs(
        self, tenant: str, sandbox_id: str, since: datetime | None, limit: int
    ) -> list[ops.LogEntry]:
        """The sandbox's events (Pal keeps no guest log): its state changes and audits."""
        await self._own(tenant, sandbox_id)
        rows = await self.listing.events(tenant, sandbox_id, after=None, limit=max(limit, 1) * 2)
        out = []
        for e in rows:
            if since is not None and e.at < since:
                continue
            text = e.reason or (f"{e.from_state} -> {e.to_state}" if e.to_state else e.kind)
            out.append(ops.LogEntry(e.at, "info", f"{e.kind}: {text}", {"kind": e.kind}))
        return out[:limit]

    async def update_network(self, tenant: str, sandbox_id: str, network: ops.NetworkPolicy) -> None:
        await self._own(tenant, sandbox_id)
        policy = _egress(network) or "open"
        await self.egress.set_egress(tenant, sandbox_id, EgressUpdate.model_validate({"egress": policy}))

    @staticmethod
    def _snapshot(k: KeptSnapshot) -> ops.Snapshot:
        return ops.Snapshot(k.snapshot_id, (k.name,) if k.name else ())

    async def create_snapshot(self, tenant: str, sandbox_id: str, name: str | None) -> ops.Snapshot:
        """Pal's kept snapshot of the sandbox (pal/scheduler/kept.py); it runs on."""
        await self._own(tenant, sandbox_id)
        return self._snapshot(await self.kept.keep(tenant, sandbox_id, name or None))

    async def list_snapshots(
        self, tenant: str, sandbox_id: str | None, name: str | None, limit: int, next_token: str | None
    ) -> ops.Page[ops.Snapshot]:
        after = None
        if next_token:
            at, snap_id = _untoken(next_token)
            try:
                after = (datetime.fromisoformat(at), snap_id)
            except ValueError:
                raise InvalidRequest("nextToken is not one this server gave") from None
        rows = self.kept.list(tenant, vm_id=sandbox_id, name=name or None, after=after, limit=limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        token = _token(rows[-1].created_at, rows[-1].snapshot_id) if more and rows else None
        return ops.Page([self._snapshot(k) for k in rows], token)

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None:
        await self.kept.delete(tenant, snapshot_id)

    async def _from_snapshot(self, tenant: str, spec: ops.CreateSandbox) -> ops.Sandbox | None:
        """A create whose template is one of the tenant's kept snapshots (by id or name):
        a sandbox started from it (Pal's start from a snapshot: the captured memory, disk
        and processes, the source's network and template), with the create's metadata
        (E2B's reserved keys: the source's template, the create's ``secure``), ``timeout``,
        ``autoPause`` and ``envVars`` (over the source's, as E2B applies them). None: the
        template is no snapshot of the tenant's."""
        try:
            found = self.kept.get(tenant, spec.template)
        except NotFound:
            return None
        try:
            source = await self.reads.get(tenant, found.source_vm_id)
        except NotFound:
            raise NotFound(f"snapshot {spec.template} not found") from None  # as start_from says
        template = source.metadata.get(conv.TEMPLATE_KEY, source.image)
        tags = _tags(spec, template)
        result = await self.kept.start(tenant, found.snapshot_id, metadata=tags, secrets=spec.env_vars)
        child = result.forks[0]
        if child.error:
            raise PalError(f"starting from snapshot {found.snapshot_id} failed: {child.error}")
        vm = await self.reads.get(tenant, child.vm_id)
        vm = await self._end_in(tenant, vm, spec.timeout_s, "pause" if spec.auto_pause else "delete")
        return self.view(vm)

    async def templates(self, tenant: str) -> list[ops.Template]:
        out = []
        for image in await self.reads.list_images(tenant):
            aliases = (image.name, "base") if image.name == "default" else (image.name,)
            created = datetime.fromisoformat(image.created_at) if image.created_at else self.now()
            if created.tzinfo is None:
                created = created.replace(tzinfo=UTC)
            out.append(ops.Template(image.name, aliases, 1, 256, 2048, created, public=False))
        return out

    # -- the agent's lookup -------------------------------------------------------------------

    async def access(self, sandbox_id: str) -> ops.SandboxAccess | None:
        """Who an agent call for ``sandbox_id`` acts for (no tenant key comes with it)."""
        vm = await self.reads.find(sandbox_id)
        if vm is None or vm.state in GONE:
            return None
        token = conv.access_token(self.secret, vm.vm_id) if conv.is_secure(vm.metadata) else None
        return ops.SandboxAccess(vm.tenant_id, vm.vm_id, token, self.state_of(vm) == "running")
