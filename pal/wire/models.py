"""Request and answer models of the node RPC (pal/wire/verbs.py declares which verb takes
and answers which). A request names its target (the VM, the snapshot) among its fields:
the path of its route is made of them (pal/wire/http.py). camelCase on the wire.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from pal.guest.xattrs import MAX_TOTAL_BYTES, parse_metadata
from pal.ids import SafeId, TenantId
from pal.spec import Egress, ExecRequest, WaitPause


class WireModel(BaseModel):
    """A body of the node's RPC (and of the API's link routes): camelCase on the wire,
    unknown fields refused. What a tenant sends is stricter (pal/spec.py: frozen, strict)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


_Model = WireModel  # what the models below derive from
M = TypeVar("M", bound=BaseModel)
MAX_METADATA_JSON = 4 * MAX_TOTAL_BYTES  # E2B's metadata of a file as JSON (escapes included)


def on_vm(model: type[M], vm_id: str, req: BaseModel) -> M:
    """A public request (pal/spec.py: an exec, a process's start, a cell) as the verb's
    request ``model``, which is it and the VM it is for."""
    return model.model_validate({**dict(req), "vm_id": vm_id})


MemMode = Literal["private", "shared"]


class RestoreFrom(_Model):
    snapshot_id: SafeId
    agent_version_id: SafeId
    source_vm_id: SafeId  # the VM that took the snapshot (== vm_id on resume)
    # The owner the control plane read from the VM's row; a snapshot of any other tenant
    # is NotFound. Callers are root-only (rpc_socket.py), so this is never a user's word.
    tenant_id: TenantId
    # private: map the snapshot's mem copy-on-write (fork children; pages shared through
    # the page cache). shared: reflink mem into the VM dir and map it shared (resume).
    mem_mode: MemMode = "shared"


class BrokeredRule(_Model):
    """One brokered secret as the node's egress gateway applies it (the real value: the
    node keeps it in memory and in its root-only state file, never in the guest)."""

    name: str
    value: str
    placeholder: str
    hosts: list[str]
    header: str | None = None
    format: str = "{value}"


class TenantCa(_Model):
    cert: str  # PEM; installed in the guest's trust store
    key: str  # PEM; the gateway signs leaf certificates with it


class BrokeredSet(_Model):
    """New values of a running VM's brokered secrets (PUT /vms/{id}/brokered)."""

    vm_id: SafeId
    brokered: list[BrokeredRule]


class BrokeredSetResult(_Model):
    vm_id: str
    rules: int


class VolumeMount(_Model):
    """A volume the VM mounts (docs/volumes.md): its id (resolved at schedule), where."""

    volume_id: SafeId
    path: str
    read_only: bool = False


class SpawnRequest(_Model):
    """Sizes have no defaults here: the caller passes what the AgentSpec resolved."""

    vm_id: SafeId
    tenant_id: TenantId
    image: SafeId
    vcpus: int
    memory_mib: int
    disk_mib: int
    incarnation: int = 1
    token: str
    env: dict[str, str] = Field(default_factory=dict)
    boot: Literal["auto", "cold"] = "auto"
    restore: RestoreFrom | None = None
    egress: Egress = "none"
    egress_mbps: int | None = None
    max_connections: int | None = None
    # disk bounds resolved at schedule (pal/scheduler/ceilings.py); None: unbounded
    disk_read_mibps: int | None = None
    disk_write_mibps: int | None = None
    disk_iops: int | None = None
    # brokered secrets: ``env`` holds their placeholders, these their values (docs/secrets.md)
    brokered: list[BrokeredRule] = Field(default_factory=list)
    tenant_ca: TenantCa | None = None
    wait_pause: WaitPause | None = None  # the node watches for wait pauses (None: off)
    volumes: list[VolumeMount] = Field(default_factory=list)  # mounted before identify


class LimitsApplied(_Model):
    """A VM's host limits as its node applied them (pal/vmm/cgroups.py, disk_limits.py):
    ``applied`` limit -> what was written; ``skipped`` limit -> why this host has none."""

    applied: dict[str, str] = Field(default_factory=dict)
    skipped: dict[str, str] = Field(default_factory=dict)


class SpawnResult(_Model):
    vm_id: str
    pid: int
    incarnation: int
    boot_ms: float
    method: Literal["cold", "template", "restore", "pool"]  # pool: claimed from the warm pool
    agent_version_id: str
    mem_snapshot_id: str | None = None  # snapshot whose mem this VM maps privately
    warm: bool = False  # a resume that continued the VM's parked QEMU (manager/parked.py)
    # Where the spawn's time went: prepare, QEMU start/load/cont, identify (host and guest
    # steps); recorded in the VM's status event (docs/lifecycle.md, "The restore path").
    timings: dict[str, float] = Field(default_factory=dict)
    limits: LimitsApplied = Field(default_factory=lambda: LimitsApplied())


class SnapshotRequest(_Model):
    vm_id: SafeId
    snapshot_id: SafeId
    agent_version_id: SafeId
    tenant_id: TenantId
    keep_running: bool
    parent_snapshot_id: SafeId | None = None
    # snapshot ids retention must keep for this VM (what paused VMs resume from, what
    # live forks map); the manager adds the ones its own live VMs map.
    protected: list[SafeId] = Field(default_factory=list)


class SnapshotResult(_Model):
    snapshot_id: str
    path: str
    sizes: dict[str, int]
    durations_ms: dict[str, float]
    memory_kind: Literal["file", "stream"]
    # the gateway's final counters of the incarnation that ended (keep_running=False)
    egress_counters: dict[str, int] | None = None
    # what the VM's snapshots on this node take now, this one in and retention done (the
    # tenant's snapshot books); None when the node could not tell
    stored_bytes: int | None = None


class EgressSet(_Model):
    """A live policy change (PUT /vms/{id}/egress)."""

    vm_id: SafeId
    egress: Egress
    egress_mbps: int | None = None
    max_connections: int | None = None


class EgressSetResult(_Model):
    closed: int  # open connections the new policy refused


class EgressEvent(_Model):
    seq: int
    at: float  # unix seconds
    vm_id: str
    kind: str
    name: str | None = None
    address: str | None = None
    port: int | None = None
    rule: str = ""
    suppressed: int | None = None


class EgressEvents(_Model):
    events: list[EgressEvent]
    seq: int  # the newest sequence number (pass it back as ``after``)
    epoch: str  # changes when the gateway's numbering restarts


LiveBy = Literal["operator", "idle", "wait"]


class LivePauseRequest(_Model):
    """Stop a live VM's vCPUs in place (docs/live-pause.md: Pause, then Offload)."""

    vm_id: SafeId
    by: LiveBy
    offload: bool = False  # right away (once the vCPUs are stopped)
    offload_after_ms: int | None = None  # or later, unless woken first
    # Wait pause: only if the gateway still holds a connection of the VM waiting on its
    # upstream (request sent, no response byte delivered); otherwise nothing happens.
    if_waiting: bool = False


class LiveState(_Model):
    """A live pause as the node knows it (None on a running VM)."""

    by: LiveBy
    since: float  # unix seconds
    offloaded: bool = False
    resident_mib: int | None = None  # guest RAM still resident (known after an offload)
    freed_mib: int = 0
    offload_ms: float | None = None
    ready: bool = False  # data is waiting for the guest in the gateway (a wake is due)
    buffered_bytes: int = 0  # response bytes the gateway holds for the guest (status only)


class LivePauseResult(_Model):
    paused: bool  # False: an if_waiting pause found nothing waiting (nothing changed)
    pause_ms: float = 0.0
    state: LiveState | None = None


class LiveResumeResult(_Model):
    resumed: bool  # False: the VM was not live-paused (nothing changed)
    resume_ms: float = 0.0
    paused_ms: int = 0  # how long it was paused
    offloaded: bool = False
    freed_mib: int = 0
    buffered_bytes: int = 0  # response bytes the gateway held for the guest meanwhile


class Notice(_Model):
    """Something the node saw that the scheduler acts on (GET /notices, long poll).

    - ``wait-ready``: a VM with wait management is idle and waits on held I/O: pause it?
    - ``wake``: a VM live-paused by idle or wait should run again (``reason``: data, timer)
    - ``offloaded``: a live-paused VM's RAM was handed back (``ms``, ``freedMib``; ``since``
      and ``by`` name the live pause it belongs to, so the scheduler counts each offload
      once however often, and however late, it hears of it)
    """

    seq: int
    at: float  # unix seconds
    vm_id: str
    kind: Literal["wait-ready", "wake", "offloaded"]
    reason: str | None = None
    ms: float | None = None
    freed_mib: int | None = None
    resident_mib: int | None = None
    since: float | None = None  # offloaded: the live pause's start (LiveState.since)
    by: LiveBy | None = None  # offloaded: who paused it


class Notices(_Model):
    notices: list[Notice]
    seq: int  # the newest sequence number (pass it back as ``after``)
    epoch: str  # changes when the node's numbering restarts


class SnapshotStatus(_Model):
    complete: bool
    meta: dict[str, object] | None = None


class VmActivity(_Model):
    """One VM in the node heartbeat. ``has_active_exec`` and ``last_activity_unix_ms`` are
    host-observed (requests through the manager); ``guest_*`` are the harness's claims,
    validated but untrusted (the scheduler bounds what they may add: idle.py)."""

    vm_id: str
    alive: bool
    pid: int | None = None
    incarnation: int | None = None
    has_active_exec: bool = False
    last_activity_unix_ms: int = 0
    guest_active: bool = False
    guest_last_activity_unix_ms: int = 0
    # when the guest was last heard from (a heartbeat, or output held back by backpressure)
    last_heartbeat_unix_ms: int = 0
    # that silence in CPU time (pal/vmm/host_cpu.py): what staleness is judged by; None
    # from a node that does not report it (wall time then)
    silent_cpu_ms: int | None = None
    live: LiveState | None = None  # set while live-paused


class NodeCapacity(_Model):
    """What a node offers VMs (placement's hard constraints)."""

    memory_mib: int = 0  # guest RAM the node may hand out in total (PAL_NODE_MEMORY_MIB)
    vcpus: int = 0
    disk_free_mib: int = 0  # free space of the data dir's file system now


class WarmTemplate(_Model):
    """A warm template the node holds: schedules of this image build and size restore it."""

    agent_version_id: str
    memory_mib: int
    vcpus: int
    disk_mib: int


class NodeHeartbeat(_Model):
    """A node's report: pulled by the control plane (``GET /heartbeat``) and pushed by the
    node to ``POST /v1/nodes/heartbeat`` every ``PAL_NODE_HEARTBEAT_INTERVAL`` seconds."""

    node_id: str
    accel: str
    vms: list[VmActivity]
    epoch: str = ""  # a new value each time the node process starts
    url: str = ""  # where the control plane reaches its RPC ("" for an embedded node)
    region: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    capacity: NodeCapacity = Field(default_factory=NodeCapacity)
    templates: list[WarmTemplate] = Field(default_factory=list)
    images: list[ImageInfo] = Field(default_factory=list)
    healthy: bool = True
    health: str | None = None  # why not healthy


class HeartbeatAck(_Model):
    """The control plane's answer to a pushed heartbeat."""

    node_id: str
    state: str  # active | draining | lost (as the control plane sees the node)
    stopping: list[str] = Field(default_factory=list)  # VMs it must not run (being stopped)


class StreamError(_Model):
    """What an ``error`` line of the node's NDJSON streams (exec, a process's output)
    carries: the guest's error ``code`` and ``message``, or an error of the node itself
    after the stream started, with the ``status`` it answers with. The client raises the
    latter as that error (client.py); a guest's code comes without one and is mapped by
    guest_errors.py."""

    code: str | None = None
    message: str | None = None
    status: int | None = None


class ExecEvent(StreamError):
    """One line of the exec NDJSON stream; mirrors the API's SSE events."""

    # ``process``: the first event, naming the exec's process (``process_id``), whose output
    # stays readable by that id (pal/manager/processes.py). ``detached``: the stream ended
    # before the command did (``reason``: slow-reader); the process runs on.
    type: Literal["process", "stdout", "stderr", "exit", "error", "detached"]
    process_id: int | None = None
    data: str | None = None
    exit_code: int | None = None
    reason: str | None = None


class FileList(_Model):
    path: str
    entries: list[dict[str, object]]
    truncated: bool


class FileWritten(_Model):
    path: str
    bytes_written: int


class FileDeleted(_Model):
    path: str
    deleted: bool


class MetricFigures(BaseModel):
    """The figures of one per-VM sample, null where one is not known (pal/manager/metrics.py
    says where each comes from)."""

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


class MetricSample(_Model, MetricFigures):
    """One per-VM sample, as the node's RPC sends it."""


class VmMetrics(_Model):
    vm_id: str
    interval_secs: float
    window_secs: float
    live: bool  # the VM runs on this node now (false: its last samples, or none)
    cpu_source: str | None = None  # "cgroup" | "proc"
    samples: list[MetricSample]


class NodeStats(_Model):
    """Operator figures of one node (for /metrics)."""

    node_id: str
    accel: str
    vms_live: int
    snapshot_bytes_local: int  # allocated bytes under the local snapshot tier
    snapshot_bytes_s3: int | None  # object bytes under snapshots/ in S3; null without S3
    s3_queue_depth: int  # S3 jobs waiting (uploads, deletes, retention), incl. retries
    seal_queue_depth: int
    stats_age_secs: float  # how old the snapshot byte counts are (they are cached)
    # The warm pool (pool.py): VMs ready to claim, the target, their QEMUs' RSS, claims.
    pool_ready: int = 0
    pool_target: int = 0
    pool_rss_bytes: int = 0
    pool_claims: int = 0
    pool_misses: int = 0
    # Pre-started QEMUs (prestart.py): waiting, the target, their RSS, restores that took one.
    prestart_ready: int = 0
    prestart_target: int = 0
    prestart_rss_bytes: int = 0
    prestart_takes: int = 0
    prestart_misses: int = 0


class SnapshotInfo(_Model):
    snapshot_id: str
    created_at: str | None = None
    sizes: dict[str, int] = Field(default_factory=dict)
    sealed: bool = False
    memory_kind: str | None = None
    parent_snapshot_id: str | None = None
    stored_bytes: int = 0  # allocated on disk (what counts against a tenant's snapshot limit)


class SnapshotOwners(_Model):
    """Every (agentVersionId, vmId) with snapshots on a node's tiers (for the sweep)."""

    vms: list[tuple[str, str]] = Field(default_factory=list)


class ImageInfo(_Model):
    """One image of this node, as the scheduler and `pal image ls` see it."""

    name: str
    agent_version_id: str  # the content digest: snapshots and templates are filed under it
    kind: str = "debian"  # debian | import | dockerfile
    source: str | None = None
    source_digest: str | None = None  # image id (config digest) of an imported or built image
    created_at: str | None = None
    size_bytes: int = 0  # the unpacked tree
    rootfs_bytes: int = 0
    tenants: list[str] | None = None  # tenant ids that may use it; None: every tenant
    config: dict[str, object] = Field(default_factory=dict)  # exec defaults (user, env, workdir...)
    templates: list[str] = Field(default_factory=list)  # warm sizes, e.g. "256m-1c-2048d"
    current: bool = True  # False: built from older guest files, re-assembled at the next start


class WarmRequest(_Model):
    image: str
    memory_mib: int
    vcpus: int
    disk_mib: int


class WarmResult(_Model):
    key: str
    ready: bool


class ImageList(_Model):
    images: list[ImageInfo]


class SnapshotList(_Model):
    snapshots: list[SnapshotInfo]


# ---------------------------------------------------------------------- what a request names


class Empty(_Model):
    """A request of the node itself (its heartbeat, stats, images)."""


class VmRef(_Model):
    vm_id: SafeId


class StopVm(_Model):
    vm_id: SafeId
    # only if the VM here runs that incarnation: stray cleanup never stops a newer one
    incarnation: int | None = None


class Stopped(_Model):
    vm_id: str
    stopped: bool  # False: the VM here runs another incarnation (nothing was done)


class LiveStatus(_Model):
    live: LiveState | None  # None: the VM runs (not live-paused)


class NoticesAfter(_Model):
    after: int = 0
    epoch: str = ""
    wait_s: float = Field(default=0.0, ge=0, le=300)


class EventsAfter(_Model):
    after: int = 0
    epoch: str = ""


class EgressCounters(_Model):
    counters: dict[str, int] | None  # None: the gateway cannot tell


class ExecCall(ExecRequest):
    """An exec on a VM: the public request (pal/spec.py) and the VM it runs in."""

    vm_id: SafeId


class PortOpen(_Model):
    vm_id: SafeId
    port: int = Field(ge=1, le=65535)


class FilesAt(_Model):
    vm_id: SafeId
    path: str = ""


class FileRef(_Model):
    vm_id: SafeId
    path: str


class FileWrite(_Model):
    vm_id: SafeId
    path: str
    data: bytes  # the body (pal/wire/http.py: a bytes field travels raw)
    # E2B's file metadata (pal/guest/xattrs.py): a JSON object that replaces the file's
    # ``user.e2b.*`` xattrs ("{}" clears them); absent: they are left as they were. JSON in
    # one field because the body is the file and the rest travels in the query.
    metadata: str | None = Field(default=None, max_length=MAX_METADATA_JSON)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, raw: str | None) -> str | None:
        if raw is not None:
            parse_metadata(raw)
        return raw


class FileContent(_Model):
    data: bytes  # cut at MAX_FILE_BYTES
    truncated: bool


class WatchNew(_Model):
    """A directory of the guest to watch with inotify (pal/guest/watches.py)."""

    vm_id: SafeId
    path: str = Field(pattern=r"^/", max_length=4096)
    recursive: bool = False


class WatchRef(_Model):
    vm_id: SafeId
    watch_id: SafeId  # w-<16 hex> (the guest's)


class WatchRead(WatchRef):
    wait_ms: int = Field(0, ge=0, le=10_000)  # a long poll: waits this long for an event


class WatchMade(_Model):
    watch_id: str = Field(max_length=32)


class WatchEvent(_Model):
    name: str = Field(max_length=4096)
    op: Literal["create", "write", "remove", "rename", "chmod"]


class WatchEvents(_Model):
    events: list[WatchEvent] = Field(max_length=4096)
    dropped: int = Field(ge=0)  # events lost to the watch's bound since the last read


class WatchDeleted(_Model):
    watch_id: str = Field(max_length=32)
    deleted: bool


class WorkloadUserName(_Model):
    """The workload user under another name, its home a view of the workspace (E2B's `user`)."""

    vm_id: SafeId
    name: str = Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    home: str = Field(pattern=r"^(/[A-Za-z0-9._-]+)+$", max_length=200)


class WorkloadUserNamed(_Model):
    name: str = Field(max_length=32)
    home: str = Field(max_length=200)
    changed: bool  # false: it had that name and home already


class VmSnapshots(_Model):
    agent_version_id: SafeId
    vm_id: SafeId


class VmSnapshotsDelete(VmSnapshots):
    keep: list[SafeId] = Field(default_factory=list)


class SnapshotsDeleted(_Model):
    deleted: list[str]


class SnapshotAt(_Model):
    agent_version_id: SafeId
    vm_id: SafeId
    snapshot_id: SafeId


class Uploaded(_Model):
    uploaded: bool


class SnapshotDeleted(_Model):
    deleted: bool
