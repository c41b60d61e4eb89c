"""Fork: N children of a VM from one snapshot of it (docs/lifecycle.md, "fork"). The source
stays as it was; the children start -> spawning -> running together, or fail.

Decision the spec leaves open: a fork whose snapshot fails returns normally with every
child FAILED (error set), so the caller sees the child ids; the source stays RUNNING unless
its QEMU died.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pal import failpoints
from pal.errors import Conflict, InvalidRequest, NotFound, public_message
from pal.scheduler import states
from pal.scheduler.deps import Deps, as_pal, new_snapshot_id, new_token, new_vm_id
from pal.scheduler.lifetime import inherited_end
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.spawning import Spawner, came_up
from pal.scheduler.states import Action, VmState, has_live_qemu
from pal.scheduler.views import ForkChild, ForkResult
from pal.spec import check_metadata, check_secrets
from pal.store import VmRecord, utcnow
from pal.store import volumes as volume_rows
from pal.store.kept import KeptSnapshot
from pal.wire import verbs
from pal.wire.models import RestoreFrom, SnapshotRequest, SnapshotResult

S, A = VmState, Action


def fork_mem_mode(vm: VmRecord, copies: int) -> Literal["private", "shared"]:
    """How a fork child maps its RAM (docs/lifecycle.md, "What a copy shares"): where the
    fork makes several copies on the child's node (``copies``), copy-on-write from the
    snapshot's fork memory (``private``: pages shared with its siblings through one page
    cache); a single copy, or a child that may be offloaded, gets RAM of its own in a file
    (``shared``: a reflinked copy, cheap to snapshot, its dirty pages writable back, and it
    may take a pre-started QEMU; MAP_PRIVATE pages it dirtied are anonymous and, without
    swap, could never leave memory)."""
    if copies < 2 or vm.wait_pause or vm.idle_live_pause_secs:
        return "shared"
    return "private"


@dataclass(frozen=True)
class ChildSettings:
    """What a fork or a start from a kept snapshot gives each child besides the source's
    settings: tags instead of the source's (None: the source's), secrets (their stored
    form, pal/scheduler/brokering.py) set over the source's."""

    metadata: dict[str, str] | None = None
    secrets: dict[str, Any] = dataclasses.field(default_factory=dict)


def child_row(src: VmRecord, snap_id: str, now_ms: int, given: ChildSettings | None = None) -> VmRecord:
    """A fork child's row: the source's settings, its own identity; ``given``'s tags
    instead of the source's, and its secrets over the source's (checked and sealed by the
    caller: ``Forking.settings``)."""
    metadata = given.metadata if given is not None else None
    secrets = {**src.secrets, **(given.secrets if given is not None else {})}
    now = utcnow()
    return VmRecord(
        vm_id=new_vm_id(),
        tenant_id=src.tenant_id,
        image=src.image,
        limits=dict(src.limits),
        created_at=now,
        updated_at=now,
        agent_version_id=src.agent_version_id,
        idle_timeout_secs=src.idle_timeout_secs,
        secrets=secrets,
        boot=src.boot,
        parent_vm_id=src.vm_id,
        mem_snapshot_id=snap_id,
        incarnation=1,  # its own identity: a fresh incarnation line and token
        token=new_token(),
        last_activity_unix_ms=now_ms,
        egress=src.egress,
        placement=src.placement,
        wait_pause=src.wait_pause,
        idle_live_pause_secs=src.idle_live_pause_secs,
        # the source's tags unless others are given (its id: parent_vm_id, shown as forkedFrom)
        metadata=dict(src.metadata if metadata is None else metadata),
        lifetime_ends_at=inherited_end(src, now),
        on_lifetime_end=src.on_lifetime_end,
    )


@dataclass(frozen=True)
class Forking:
    d: Deps
    spawner: Spawner
    books: SnapshotBooks

    def settings(
        self, tenant_id: str, metadata: Mapping[str, str] | None, secrets: Mapping[str, Any] | None
    ) -> ChildSettings:
        """The children's own tags and secrets, by the schedule's rules (pal/spec.py
        ``check_metadata``, ``check_secrets``: 400 else, before anything starts); the
        secrets sealed as a schedule stores them."""
        try:
            tags = None if metadata is None else check_metadata(dict(metadata))
            given = check_secrets(dict(secrets)) if secrets else {}
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(str(exc)) from None
        sealed = self.spawner.brokering.store_form(tenant_id, given) if given else {}
        return ChildSettings(tags, sealed)

    def _check_merged(self, src: VmRecord, given: ChildSettings) -> None:
        """The source's secrets with the given ones set over them are still within a
        schedule's bounds (count, total size: a child may boot from its config drive),
        checked on their values (a brokered one's real value, as a schedule counts it)."""
        if not given.secrets:
            return
        merged = {**src.secrets, **given.secrets}
        broker = self.spawner.brokering
        values = broker.env(src.tenant_id, merged) | {
            r.name: r.value for r in broker.rules(src.tenant_id, merged)
        }
        try:
            check_secrets(values)
        except ValueError as exc:
            raise InvalidRequest(f"the source's secrets with the given ones: {exc}") from None

    async def fork(
        self,
        tenant_id: str,
        vm_id: str,
        count: int,
        metadata: Mapping[str, str] | None = None,
        secrets: Mapping[str, Any] | None = None,
    ) -> ForkResult:
        """``count`` children of ``vm_id``, tagged ``metadata`` instead of the source's tags
        when given, with ``secrets`` (a schedule's) set over the source's.

        Prerequisites: 1 <= count <= PAL_MAX_FORK_COUNT (400); FORK_FROM allowed (running,
        or paused: a live-paused source is captured and stays paused, a snapshot-paused one
        forks from its pause snapshot, 409 without one). Placement and all N slots are
        checked before any row or snapshot exists (503 NO_NODE, 402 leave nothing).
        Success: each child running (or failed, with its error); the source unchanged.
        Failure of the fork snapshot: every child failed; the source failed only if its
        QEMU died."""
        self._check_count(count)
        given = self.settings(tenant_id, metadata, secrets)
        d = self.d
        d.own(tenant_id, vm_id)
        t0 = time.perf_counter()
        async with d.locks.op_lock(vm_id):
            src = d.reload(vm_id)
            states.check(vm_id, src.state, A.FORK_FROM, src.marker)
            self._check_merged(src, given)
            # A live source (running, or live-paused: it stays paused) is captured now; a
            # snapshot-paused one forks from its pause snapshot.
            live_source = has_live_qemu(src.state, src.marker)
            if not live_source and not src.snapshot_id:
                raise Conflict(f"paused VM {vm_id} has no snapshot to fork from")
            snap_id = new_snapshot_id() if live_source else src.snapshot_id or ""
            children = [child_row(src, snap_id, d.now_ms(), given) for _ in range(count)]
            async with self.spawner.placing:
                # Placed before any row exists (503 NO_NODE leaves nothing; the next
                # placement counts them already), then all N rows and slots in one
                # transaction, before any snapshot I/O (402 leaves nothing).
                reasons = self.spawner.place_children(src, children)
                for c in children:
                    d.live.hold(c, c.node_id or "")
            try:
                await d.transitions.create(
                    tenant_id,
                    children,
                    A.FORK,
                    reasons=[f"fork of {vm_id}; {r}" for r in reasons],
                    # a running source is snapshotted for them: the tenant's snapshot limit
                    new_snapshot_bytes=self.books.estimate(src) if src.state == S.RUNNING else 0,
                )
            except BaseException:
                for c in children:
                    d.live.forget(c.vm_id)
                raise
            volume_rows.copy_mounts(d.store, vm_id, [c.vm_id for c in children])  # docs/volumes.md
            failpoints.hit("fork:reserved")
            if live_source:
                taken = await self.capture(src, snap_id)
                if isinstance(taken, str):
                    error = taken
                    for c in children:
                        await d.transitions.transition(
                            c.vm_id, A.FAIL_SPAWN, reason=error, mem_snapshot_id=None
                        )
                    return ForkResult(vm_id, snap_id, [ForkChild(c.vm_id, S.FAILED, error) for c in children])
                await self.books.record_bytes(vm_id, taken)
            failpoints.hit("fork:snapshotted")
        forks = await self._spawn_children(src, children, snap_id)
        d.telemetry.fork.observe(time.perf_counter() - t0)
        return ForkResult(source_vm_id=vm_id, snapshot_id=snap_id, forks=forks)

    def _check_count(self, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidRequest("count must be an integer")
        limit = self.d.settings.max_fork_count
        if count < 1 or count > limit:
            raise InvalidRequest(f"count must be between 1 and {limit} (PAL_MAX_FORK_COUNT), got {count}")

    async def start_from(
        self,
        tenant_id: str,
        kept: KeptSnapshot,
        count: int = 1,
        metadata: Mapping[str, str] | None = None,
        secrets: Mapping[str, Any] | None = None,
    ) -> ForkResult:
        """``count`` new VMs from a kept snapshot (pal/scheduler/kept.py): fork children of
        the VM it was taken of, which may be running, paused or gone (its row stays); each
        tagged ``metadata`` when given (it replaces the source's tags; 400 when it breaks
        the tags' rule), else with the source's tags; ``secrets`` (a schedule's, its rule)
        set over the source's (its guest's environment from then on: every exec sees them).

        Prerequisites: the tenant's kept snapshot (the caller looked it up: 404 else);
        1 <= count <= PAL_MAX_FORK_COUNT. Placed on the snapshot's node while it has room,
        else (S3 configured) on another node, which restores it from S3; without S3 only its
        node will do (503 NO_NODE). Success: each child running with the captured memory,
        disk and processes, its own identity; nothing of the source changes (no lock of it
        is taken: the snapshot's files never change). Failure: the child failed, its error
        set (a snapshot deleted meanwhile, a node that cannot restore it)."""
        self._check_count(count)
        given = self.settings(tenant_id, metadata, secrets)
        d = self.d
        src = d.store.get_vm(kept.source_vm_id)
        if src is None or src.tenant_id != tenant_id:
            raise NotFound(f"snapshot {kept.snapshot_id} not found")
        self._check_merged(src, given)
        # Where the snapshot is, and of which build: the source may have moved since.
        src = dataclasses.replace(src, node_id=kept.node_id, agent_version_id=kept.agent_version_id)
        children = [child_row(src, kept.snapshot_id, d.now_ms(), given) for _ in range(count)]
        only = None if d.settings.s3_enabled else kept.node_id
        async with self.spawner.placing:
            reasons = self.spawner.place_children(src, children, only=only)
            for c in children:
                d.live.hold(c, c.node_id or "")
        try:
            await d.transitions.create(
                tenant_id,
                children,
                A.FORK,
                reasons=[f"from snapshot {kept.snapshot_id}; {r}" for r in reasons],
            )
        except BaseException:
            for c in children:
                d.live.forget(c.vm_id)
            raise
        volume_rows.copy_mounts(d.store, src.vm_id, [c.vm_id for c in children])
        forks = await self._spawn_children(src, children, kept.snapshot_id)
        return ForkResult(source_vm_id=src.vm_id, snapshot_id=kept.snapshot_id, forks=forks)

    async def capture(self, src: VmRecord, snap_id: str) -> SnapshotResult | str:
        """Snapshot a running source, keeping it running; the error text on failure."""
        try:
            return await self.d.node(src).call(
                verbs.SNAPSHOT,
                SnapshotRequest(
                    vm_id=src.vm_id,
                    snapshot_id=snap_id,
                    agent_version_id=src.agent_version_id or "",
                    tenant_id=src.tenant_id,
                    keep_running=True,
                    parent_snapshot_id=src.snapshot_id,
                    protected=self.books.protected(src),
                ),
            )
        except Exception as exc:
            err = as_pal(exc)
            if await self.d.is_alive(src, src.incarnation) is False:
                await self.d.transitions.transition(
                    src.vm_id, A.LOSE, reason=f"QEMU exited during a fork snapshot: {err.message}"
                )
            return f"fork snapshot failed: {public_message(err.message)}"

    async def _spawn_children(self, src: VmRecord, children: list[VmRecord], snap_id: str) -> list[ForkChild]:
        """Restore every child (at most PAL_FORK_CONCURRENCY requests at once, which the node
        admits by its free CPU: pal/manager/restore_gate.py), then move the ones
        that came up to RUNNING in ONE transaction: a control plane that dies before it
        leaves every child SPAWNING, and reconciliation fails them all (a fork is all or
        nothing across a failover). Holds each child's operation lock throughout."""
        d = self.d
        if any(c.node_id != src.node_id for c in children) and src.node_id is not None:
            await self.books.publish(src, src.node_id, snap_id)
        sem = asyncio.Semaphore(max(1, d.settings.fork_concurrency))
        async with contextlib.AsyncExitStack() as stack:
            for c in sorted(children, key=lambda c: c.vm_id):
                await stack.enter_async_context(d.locks.op_lock(c.vm_id))
            here = Counter(c.node_id for c in children)  # the copies each node makes
            results = await asyncio.gather(
                *(self._spawn_child(src, c.vm_id, snap_id, sem, here[c.node_id]) for c in children)
            )
            up = [(cid, fields) for cid, fields, _ in results if fields is not None]
            failpoints.hit("fork:spawned")
            if up:
                await d.transitions.transition_all(up, A.COME_UP)
        out = []
        for cid, fields, settled in results:
            if fields is not None:
                d.telemetry.started(cid, "fork")
                out.append(ForkChild(cid, S.RUNNING))
            else:
                assert settled is not None
                out.append(settled)
        return out

    async def _spawn_child(
        self, src: VmRecord, child_id: str, snap_id: str, sem: asyncio.Semaphore, copies: int
    ) -> tuple[str, dict[str, Any] | None, ForkChild | None]:
        """(child id, COME_UP fields if it came up, else how it ended); ``copies``: the
        children its node restores from the snapshot (fork_mem_mode)."""
        d = self.d
        async with sem:
            child = d.reload(child_id)
            if not states.allowed(S(child.state), A.COME_UP, child.marker):
                return child_id, None, ForkChild(child_id, S(child.state), child.reason)
            restore = RestoreFrom(
                snapshot_id=snap_id,
                agent_version_id=src.agent_version_id or "",
                source_vm_id=src.vm_id,
                tenant_id=src.tenant_id,
                mem_mode=fork_mem_mode(child, copies),
            )
            try:
                res = await d.node(child).call(verbs.SPAWN, self.spawner.request(child, restore))
            except Exception as exc:
                err = as_pal(exc)
                await d.transitions.transition(
                    child_id, A.FAIL_SPAWN, reason=f"fork spawn failed: {err.message}"
                )
                return child_id, None, ForkChild(child_id, S.FAILED, public_message(err.message))
            fields = {
                "agent_version_id": res.agent_version_id or child.agent_version_id,
                "mem_snapshot_id": res.mem_snapshot_id or snap_id,
                "last_activity_unix_ms": d.now_ms(),
                **came_up(res),
            }
            return child_id, fields, None
