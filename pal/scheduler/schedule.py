"""Schedule: a new VM from an AgentSpec, reserved, placed and started (docs/lifecycle.md,
"schedule"): start -> pending -> spawning -> running, or failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pal import failpoints
from pal.errors import Conflict, InvalidRequest, PalError
from pal.scheduler import ceilings, placement
from pal.scheduler.brokering import SecretBroker
from pal.scheduler.deps import Deps, as_pal, new_token, new_vm_id
from pal.scheduler.lifetime import ends_at
from pal.scheduler.spawning import Spawner, came_up
from pal.scheduler.states import Action
from pal.scheduler.volumes import Volumes
from pal.spec import AgentSpec, WaitPause, egress_to_json
from pal.store import VmRecord, VolumeRecord, utcnow
from pal.store import volumes as volume_rows
from pal.volume_spec import VolumeMountSpec
from pal.wire import verbs

A = Action


@dataclass(frozen=True)
class Scheduling:
    d: Deps
    spawner: Spawner
    brokering: SecretBroker

    async def schedule(self, tenant_id: str, spec: AgentSpec) -> tuple[VmRecord, str]:
        """The running VM and how it started (`cold`, `template`).

        Prerequisites: none (SCHEDULE from start). Everything that can be checked is checked
        before any row or slot exists: 404 for an image the tenant cannot use, 400 for a
        placement no node could ever satisfy, then 402 (no slot) leaves no row.
        Success: running, on the node placement chose (its reason in the status event).
        Failure: failed (503 NO_NODE, or the node's spawn error); the node leaves no QEMU."""
        d = self.d
        settings = d.settings
        spec = ceilings.apply(  # PAL_MAX_*, PAL_DISK_*
            spec, settings.net_budgets, settings.wait_pause_default, settings.disk_bounds
        )
        await self.spawner.require_image(tenant_id, spec.image)
        await d.nodes.register_local()
        placement.check_satisfiable(d.nodes.nodes(), spec.placement.region, dict(spec.placement.labels))
        t0 = time.perf_counter()
        mounts = self._volumes(tenant_id, spec)  # 404 for another tenant's, as for none
        vm = self._row(tenant_id, spec)
        async with d.locks.op_lock(vm.vm_id):
            await d.transitions.create(tenant_id, [vm], A.SCHEDULE)  # 402 here leaves no row
            try:
                for vol, m in mounts:
                    volume_rows.add_mount(d.store, vol.volume_id, vm.vm_id, m.path, read_only=m.read_only)
            except PalError as exc:  # a volume deleted since it was checked
                await d.transitions.transition(vm.vm_id, A.FAIL_SPAWN, reason=exc.message)
                raise
            failpoints.hit("schedule:reserved")
            async with self.spawner.placing:
                try:
                    choice = await self.spawner.choose(vm, restore=False)
                except PalError as exc:
                    await d.transitions.transition(vm.vm_id, A.FAIL_SPAWN, reason=exc.message)
                    raise
                d.live.hold(vm, choice.node_id)  # the next placement counts it already
            try:
                # The node and the reason it was chosen go with PENDING -> SPAWNING.
                vm = await d.transitions.transition(
                    vm.vm_id, A.PLACE, reason=choice.reason, node_id=choice.node_id
                )
            except BaseException:
                d.live.apply(vm)  # placed nowhere after all
                raise
            try:
                res = await d.node(vm).call(verbs.SPAWN, self.spawner.request(vm, None))
            except Exception as exc:
                err = as_pal(exc)
                # The manager leaves no QEMU behind on failure (api.py), so FAILED is final.
                await d.transitions.transition(vm.vm_id, A.FAIL_SPAWN, reason=f"spawn failed: {err.message}")
                raise err from exc
            failpoints.hit("schedule:spawned")
            vm = await d.transitions.transition(
                vm.vm_id,
                A.COME_UP,
                **came_up(res),
                agent_version_id=res.agent_version_id,
                last_activity_unix_ms=d.now_ms(),
            )
        d.telemetry.schedule.labels(boot=res.method).observe(time.perf_counter() - t0)
        d.telemetry.started(vm.vm_id, "schedule")
        return vm, res.method

    def _volumes(self, tenant_id: str, spec: AgentSpec) -> list[tuple[VolumeRecord, VolumeMountSpec]]:
        """The tenant's ready volumes the spec mounts (docs/volumes.md)."""
        out = []
        for m in spec.volumes:
            vol = Volumes(self.d).own(tenant_id, m.name)
            if vol.state != "ready":
                raise Conflict(f"volume {vol.name!r} is {vol.state}")
            out.append((vol, m))
        if len({v.volume_id for v, _ in out}) != len(out):
            raise InvalidRequest("each volume at most once (by name or id)")
        return out

    def _row(self, tenant_id: str, spec: AgentSpec) -> VmRecord:
        now = utcnow()
        settings = self.d.settings
        return VmRecord(
            vm_id=new_vm_id(),
            tenant_id=tenant_id,
            image=spec.image,
            limits=spec.limits.model_dump(),
            created_at=now,
            updated_at=now,
            idle_timeout_secs=spec.idle_timeout_secs,
            secrets=self.brokering.store_form(tenant_id, spec.secrets),
            boot=spec.boot,
            incarnation=1,
            token=new_token(),
            last_activity_unix_ms=self.d.now_ms(),
            egress=egress_to_json(spec.egress if spec.egress is not None else settings.egress_default),
            placement=spec.placement.model_dump() if spec.placement.region or spec.placement.labels else None,
            wait_pause=self._wait_rule(spec),
            idle_live_pause_secs=spec.idle_live_pause_secs,
            metadata=dict(spec.metadata),
            lifetime_ends_at=ends_at(now, spec.lifetime_secs),
            on_lifetime_end=spec.on_lifetime_end,
        )

    def _wait_rule(self, spec: AgentSpec) -> dict[str, object] | None:
        """The VM's wait management: its spec's, else the server's (PAL_WAIT_PAUSE)."""
        wait = spec.wait_pause if spec.wait_pause is not None else self.d.settings.wait_pause_default
        return wait.model_dump(by_alias=True) if isinstance(wait, WaitPause) else None
