"""Response bodies of the REST API (camelCase on the wire).

Declared as pydantic models so `/openapi.json` documents every shape; request bodies are
the models of pal/spec.py (`AgentSpec`, `ExecRequest`, `ForkRequest`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer
from pydantic.alias_generators import to_camel

from pal.limits import Limits
from pal.scheduler.lifetime import lifetime_secs
from pal.spec import Egress, WaitPause
from pal.store import VmRecord


class _Out(BaseModel):
    # from_attributes: built from the store's and scheduler's records by field name.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, from_attributes=True)
    # Optional fields left out while null, so that the spec's shapes (e.g. resume: {vmId,
    # snapshotId, state}) stay exact for VMs that never use the feature behind them.
    _omit_null: ClassVar[frozenset[str]] = frozenset()

    # No return annotation on purpose: with one, pydantic documents the model as that type.
    @model_serializer(mode="wrap")
    def _drop_omitted_nulls(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        out = handler(self)
        if isinstance(out, dict):
            for name in self._omit_null:
                for key in (name, type(self).model_fields[name].alias):
                    if key in out and out[key] is None:
                        del out[key]
        return out


class NetworkOut(_Out):
    bytes_in: int = Field(description="bytes delivered to the guest")
    bytes_out: int = Field(description="bytes the guest sent")
    connections: int = Field(description="TCP connections the guest opened")
    refused: int = Field(description="connections and DNS lookups the egress policy refused")
    dns_queries: int
    active: int | None = Field(default=None, description="open connections now (running VMs)")


class PauseOut(_Out):
    """What kind of pause a paused VM is in (its tier)."""

    kind: str = Field(
        description="`live`: the same QEMU, vCPUs stopped, slot kept; `snapshot`: in a snapshot, slot freed"
    )
    by: str | None = Field(default=None, description="`operator`, `idle` or `wait`")
    since: datetime | None = None
    offloaded: bool | None = Field(default=None, description="live: the guest's RAM was handed back")
    resident_mib: int | None = Field(
        default=None,
        alias="residentMiB",
        description="live: guest RAM still resident on the host, MiB (measured now)",
    )
    _omit_null = frozenset({"offloaded", "resident_mib"})


class LiveStatsOut(_Out):
    """Live pauses over the VM's life."""

    live_pauses: int = 0
    wait_pauses: int = 0
    live_paused_ms: int = Field(default=0, description="total time live-paused (finished pauses)")
    offloads: int = 0
    freed_mib: int = Field(default=0, description="resident MiB handed back by offloads, summed")
    bytes_while_paused: int = Field(default=0, description="response bytes the host held while paused")


class LimitsAppliedOut(_Out):
    """The host limits the VM's node applied when it last came up (docs/limits.md)."""

    applied: dict[str, str] = Field(
        default_factory=dict,
        description="limit -> what holds it: `cpu`, `memory`, `pids` (its cgroup), `ioWeight`, "
        "`diskKernel` (the kernel's disk throttle), `diskQemu` (QEMU's)",
    )
    skipped: dict[str, str] = Field(
        default_factory=dict, description="limit -> why this VM's host does not have it"
    )


class VmOut(_Out):
    """A VM as the API shows it: the public columns of the store's ``VmRecord``, read by
    name. A new VM field goes in store/records.py, store/tables.py (+ a migration) and,
    if clients see it, here."""

    vm_id: str
    state: str
    image: str
    limits: Limits
    created_at: datetime
    snapshot_id: str | None = None
    parent_vm_id: str | None = None
    reason: str | None = None
    idle_timeout_secs: int = 0
    paused_by: str | None = Field(
        default=None,
        description="`operator`, `idle`, `recovery` (its QEMU was lost at a restart: paused from its newest"
        " snapshot, see its `recovered` event) or null; only idle-paused VMs wake",
    )
    boot_method: str | None = Field(
        default=None,
        description="on schedule answers: how the VM started (`template`, `cold`); null elsewhere",
    )
    egress: Egress = Field(default="none", description="the VM's egress policy")
    network: NetworkOut | None = Field(
        default=None, description="network counters over the VM's life (GET of one VM only)"
    )
    idle_live_pause_secs: int = 0
    wait_pause: WaitPause | None = Field(default=None, description="wait management; null: off")
    pause: PauseOut | None = Field(
        default=None, description="paused VMs: the kind of pause (GET of one VM); absent otherwise"
    )
    live_stats: LiveStatsOut | None = Field(default=None, description="live pauses over the VM's life")
    metadata: dict[str, str] = Field(
        default_factory=dict, description="the tags given at schedule (or inherited)"
    )
    forked_from: str | None = Field(default=None, description="a fork child: the VM it was forked from")
    lifetime_secs: int | None = Field(
        default=None, description="its lifetime, counted from its schedule; null: none (or it ended)"
    )
    lifetime_ends_at: datetime | None = Field(default=None, description="when its lifetime ends")
    on_lifetime_end: str = Field(
        default="delete", description="what its lifetime's end does: `pause` or `delete`"
    )
    limits_applied: LimitsAppliedOut | None = Field(
        default=None, description="the host limits of its last start; null before it first ran"
    )
    _omit_null = frozenset({"pause"})

    @classmethod
    def of(
        cls,
        vm: VmRecord,
        boot_method: str | None = None,
        network: dict[str, int] | None = None,
        pause: dict[str, Any] | None = None,
    ) -> VmOut:
        out = cls.model_validate(vm)
        out.boot_method = boot_method
        out.network = NetworkOut.model_validate(network) if network is not None else None
        out.pause = PauseOut.model_validate(pause) if pause is not None else None
        out.live_stats = LiveStatsOut.model_validate(vm.live_stats or {})
        out.forked_from = vm.parent_vm_id  # only a fork sets it
        out.lifetime_secs = lifetime_secs(vm)
        return out


class SecretRotatedOut(_Out):
    name: str
    applied: str = Field(description="`now` (the VM runs: its next request) or `next start`")


class _Page(_Out):
    """A page of a list (pal/api/pagination.py); the subclass names its items."""

    next_cursor: str | None = Field(
        default=None, description="the next page's `cursor`; absent on the last page"
    )
    _omit_null = frozenset({"next_cursor"})


class VmListOut(_Page):
    vms: list[VmOut]


class SnapshotStateOut(_Out):
    """Answer of pause and resume."""

    vm_id: str
    snapshot_id: str | None = Field(
        description="the snapshot this pause took, or this resume restored; null for a live pause"
    )
    state: str
    pause: PauseOut | None = Field(default=None, description="paused: the kind of pause; absent otherwise")
    _omit_null = frozenset({"pause"})


class ForkChildOut(_Out):
    vm_id: str
    state: str
    error: str | None = Field(default=None, description="why this child failed; absent when it runs")


class ForkOut(_Out):
    source_vm_id: str
    snapshot_id: str
    forks: list[ForkChildOut]


class ExecOut(_Out):
    exit_code: int | None = Field(default=None, description="absent only while it runs (`running`)")
    stdout: str
    stderr: str
    process_id: int | None = Field(
        default=None, description="the exec's process (`/processes/{processId}`); also `X-Pal-Process-Id`"
    )
    running: bool | None = Field(
        default=None,
        description="`yieldAfterMs` only: true when the command still runs; read on from `next`",
    )
    next: int | None = Field(
        default=None, description="`yieldAfterMs` while running: the output offset after what is here"
    )
    timed_out: bool | None = Field(
        default=None, description="true when the guest killed the command at timeoutSecs; absent otherwise"
    )
    truncated: bool | None = Field(
        default=None,
        description="true when stdout or stderr passed 8 MiB, or the tenant's buffered exec budget "
        "(PAL_EXEC_BUFFER_MIB) ran out, and was cut (use SSE for all); absent otherwise",
    )


class FileEntryOut(_Out):
    name: str
    type: str
    size: int | None = None


class FileListOut(_Out):
    path: str
    entries: list[FileEntryOut]
    truncated: bool


class FileWrittenOut(_Out):
    path: str
    bytes_written: int


class FileDeletedOut(_Out):
    path: str
    deleted: bool


class EventOut(_Out):
    """A status or audit event: the public columns of the store's ``EventRecord``."""

    at: datetime
    kind: str
    from_state: str | None = None
    to_state: str | None = None
    reason: str | None = None
    details: dict[str, Any] | None = Field(
        default=None, description="egress_denied: {name, address, port, rule, suppressed}"
    )


class EventListOut(_Page):
    events: list[EventOut]


class ErrorBody(_Out):
    code: str
    message: str
    request_id: str | None = Field(
        default=None, description="the request's id (also its X-Request-Id header); the server log has more"
    )


class ErrorOut(_Out):
    error: ErrorBody


class MetricSampleOut(_Out):
    """One sample; a figure is null when unknown (see docs/metrics.md for each source)."""

    t: int = Field(description="sample time, unix milliseconds")
    cpu_pct: float | None = Field(default=None, description="host CPU of the VM, % of one core")
    rss_bytes: int | None = Field(default=None, description="host RSS of the VM's QEMU")
    pss_bytes: int | None = Field(default=None, description="host PSS of the VM's QEMU")
    guest_mem_used_bytes: int | None = None
    guest_mem_total_bytes: int | None = None
    disk_used_bytes: int | None = None
    disk_total_bytes: int | None = None
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None
    live_paused_ms: int | None = None


class VmMetricsOut(_Out):
    vm_id: str
    interval_secs: float
    window_secs: float
    live: bool = Field(description="false: the VM is not running; these are its last samples, or none")
    cpu_source: str | None = Field(default=None, description="`cgroup` or `proc`")
    samples: list[MetricSampleOut]


class SnapshotOut(_Out):
    snapshot_id: str
    created_at: str | None = None
    sizes: dict[str, int] = Field(description="bytes per artifact (snapshot, mem, rootfs, vmm.json)")
    sealed: bool
    memory_kind: str | None = None
    parent_snapshot_id: str | None = None


class SnapshotListOut(_Page):
    snapshots: list[SnapshotOut]


class ImageOut(_Out):
    name: str = Field(description="what `image` in the AgentSpec names")
    digest: str = Field(description="content digest (`sha256-...`): a rebuilt image has a new one")
    kind: str = Field(description="`debian` (built by Pal), `import` or `dockerfile`")
    source_digest: str | None = Field(None, description="image id (config digest) of its source")
    created_at: str | None = None
    size_bytes: int = Field(0, description="unpacked size of its root file system tree")
    user: str | None = Field(None, description="the workload user: execs and files run as it")
    workdir: str | None = Field(None, description="default working directory of execs")
    env: dict[str, str] = Field(default_factory=dict, description="environment every exec starts with")
    cmd: list[str] | None = Field(None, description="the image's CMD (recorded, not run)")
    warm_sizes: list[str] = Field(
        default_factory=list, description="sizes with a warm template (`<mem>m-<vcpus>c-<disk>d`)"
    )

    @classmethod
    def from_info(cls, info: Any) -> ImageOut:
        cfg = info.config or {}
        return cls(
            name=info.name,
            digest=info.agent_version_id,
            kind=info.kind,
            source_digest=info.source_digest,
            created_at=info.created_at,
            size_bytes=info.size_bytes,
            user=cfg.get("user"),
            workdir=cfg.get("workdir"),
            env=dict(cfg.get("env") or {}),
            cmd=cfg.get("cmd"),
            warm_sizes=list(info.templates),
        )


class ImageListOut(_Page):
    images: list[ImageOut]


class HostCheckOut(_Out):
    check: str
    ok: bool | None = Field(description="false: VMs cannot start for it; null: information")
    detail: str


class HostOut(_Out):
    """GET /v1/operator/host: what the running server uses (pal/api/host_report.py)."""

    settings: dict[str, Any] = Field(description="each PAL_* variable's value in effect; secrets: `(set)`")
    checks: list[HostCheckOut] | None = Field(
        description="its host's capabilities as `pal doctor` shows them; null: it runs no VMs itself"
    )


class HealthOut(_Out):
    """/healthz: ``ok`` for anyone; the operator's token also shows what was checked."""

    model_config = ConfigDict(extra="allow")
    ok: bool


class ReadyOut(_Out):
    """/readyz: ``ready`` for anyone; the operator's token also shows ``waitingFor``."""

    model_config = ConfigDict(extra="allow")
    ready: bool
    waiting_for: str | None = Field(default=None, description="what readiness still waits for")
