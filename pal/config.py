"""Settings read from the environment (and CLI flags), in one place.

Every environment variable the server side honours is declared here, once: its name, its
default, its bounds and what it means (README's "Configuration" table is generated from
these declarations: ``python -m pal.config --markdown --write``). The client side's PAL_URL
and PAL_API_KEY are read by the SDK itself (pal/sdk/_wire.py), which imports nothing else
from pal; the tests' PAL_TEST_DATA_DIR by tests/conftest.py.

A new setting is one field of ``Settings``: ``name: Annotated[type, Env("PAL_X", "what it
means", lo=..., hi=...)] = default``. ``Settings.from_env()`` reads the environment;
keyword construction (``Settings(data_dir=...)``, the tests) reads nothing but its keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from pal import config_env, sizes
from pal.config_env import (
    E2B_PORT_DOC,
    EnvSource,
    clamp,
    read_e2b_port,
    read_egress_dns,
    read_exec_default_timeout,
    read_int,
    read_max_fork_count,
    read_nameservers,
    read_ports_port,
    read_s3_sse,
    read_switch,
    reading_env,
    setting,
)
from pal.config_env import parse_labels as parse_labels
from pal.config_env import parse_nameservers as parse_nameservers
from pal.config_env import (
    parse_pool as parse_pool,
)
from pal.config_env import (
    parse_template_sizes as parse_template_sizes,
)
from pal.spec import MAX_EXEC_TIMEOUT_S, Egress, WaitPause, parse_egress_default, parse_wait_pause_default

DEFAULT_DATA_DIR = Path("/var/lib/pal")
# The ports listener (VM ports on origins of their own): the API's port + 2 unless set (8082
# beside 8080 and a node RPC's 8081), so servers on one machine do not collide.
PORTS_PORT_OFFSET = 2
DEFAULT_PORTS_PORT = 8080 + PORTS_PORT_OFFSET
FORK_COUNT_CEILING = 1000
# A VM's disk bounds when its spec asks none: room for any ordinary workload (a package
# install, a build) while one VM's hog leaves the disk to the others (docs/benchmarks/io.md).
DEFAULT_DISK_READ_MIBPS = 200
DEFAULT_DISK_WRITE_MIBPS = 100
DEFAULT_DISK_IOPS = 4000
# A buffered exec without timeoutSecs is killed after this long (PAL_EXEC_DEFAULT_TIMEOUT): a
# command that never ends must not hold a request open. Streamed exec has no default.
EXEC_DEFAULT_TIMEOUT_S = 300.0
S3_SSE_MODES = ("AES256", "aws:kms")
_KEYS = "`$PAL_DATA_DIR/keys/"


def read_at_least(low: int) -> Callable[[str, str], int]:
    """An integer of at least ``low``: below it the setting is refused, not clamped (a
    budget of nearly nothing is a mistake, not a wish)."""

    def read(name: str, raw: str) -> int:
        value = read_int(name, raw)
        if value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")
        return value

    return read


def read_bound_or_off(name: str, raw: str) -> int | None:
    """A per-VM default bound: a positive integer, or `off` (0) for none."""
    if raw.strip().lower() in ("off", "0", "none"):
        return None
    return read_at_least(1)(name, raw)


class Settings(BaseSettings):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # type: ignore[assignment]

    data_dir: Path = setting(
        DEFAULT_DATA_DIR, "PAL_DATA_DIR", "images, snapshots, live VM files, SQLite store (`--data-dir` too)"
    )
    snapshot_dir: Path | None = setting(
        None, "SNAPSHOT_DIR", "local snapshot tier", shown="`$PAL_DATA_DIR/snapshots`"
    )
    volumes_dir: Path | None = setting(
        None,
        "PAL_VOLUMES_DIR",
        "a directory every node of a cluster mounts at this same path (NFS, CephFS, a cluster"
        " file system): volumes live there and any node serves any (docs/volumes.md)",
        shown="`$PAL_DATA_DIR/volumes`",
    )
    accel: str = setting(
        "auto", "PAL_ACCEL", "`auto` (probe KVM, fall back to TCG), `kvm` or `tcg` (`pal up --accel`)"
    )
    max_fork_count: int = setting(
        100, "PAL_MAX_FORK_COUNT", "per-call fork cap", read=read_max_fork_count, hi=FORK_COUNT_CEILING
    )
    fork_concurrency: int = setting(
        16,
        "PAL_FORK_CONCURRENCY",
        "most restores at once (a node admits fewer while its CPU is busy: restore_gate.py)",
        lo=1,
    )
    exec_default_timeout_s: float | None = setting(
        EXEC_DEFAULT_TIMEOUT_S,
        "PAL_EXEC_DEFAULT_TIMEOUT",
        "seconds a buffered exec without `timeoutSecs` may run before it is killed"
        " (`timedOut: true`); a request's own `timeoutSecs` wins; `0`: no default."
        " Streamed exec has none",
        read=read_exec_default_timeout,
        hi=MAX_EXEC_TIMEOUT_S,
    )
    harness_ready_timeout_ms: int = setting(
        5000, "PAL_HARNESS_READY_TIMEOUT_MS", "how long the first exec after a restore waits for the guest"
    )
    idle_sweep_interval_s: float = setting(10.0, "PAL_IDLE_SWEEP_INTERVAL", "idle sweeper period, seconds")
    heartbeat_interval_s: float = setting(5.0, "PAL_HEARTBEAT_INTERVAL", "guest heartbeat period, seconds")
    templates: bool = setting(
        True,
        "PAL_TEMPLATES",
        "`0` disables warm templates (always cold boot)",
        read=lambda _n, raw: raw not in ("0", "false", "no"),
        shown="`1`",
    )
    template_sizes: tuple[str, ...] | None = setting(
        sizes.DEFAULT_TEMPLATE_SIZES,
        "PAL_TEMPLATE_SIZES",
        "sizes (`<memoryMib>m-<vcpus>c-<diskMib>d`) that get a warm template on first use;"
        " other sizes boot cold; `*` = any size",
        read=lambda _n, raw: parse_template_sizes(raw),
    )
    template_builds: int = setting(
        1, "PAL_TEMPLATE_BUILDS", "template builds at once (each boots a VM)", lo=1
    )
    templates_keep: int = setting(
        8, "PAL_TEMPLATES_KEEP", "templates a node keeps; past it the least recently used are removed", lo=1
    )
    pool: tuple[tuple[str, int], ...] = setting(
        sizes.DEFAULT_POOL,
        "PAL_POOL",
        "the claimable warm pool: sizes (of the default image, or `<image>@<size>`) and how"
        " many VMs of each a node keeps restored from their template, live-paused and offloaded,"
        " for a schedule of that image and size to claim"
        " (`256m-1c-2048d:2,code-interpreter@256m-1c-2048d:1`); `0` turns it off",
        read=lambda _n, raw: parse_pool(raw),
        shown="`256m-1c-2048d:2`",
    )
    pool_memory_mib: int = setting(
        1024,
        "PAL_POOL_MEMORY_MIB",
        "the guest RAM (MiB) the pool's VMs may add up to; sizes past it get fewer VMs",
        lo=0,
    )
    parked_max: int = setting(
        8,
        "PAL_PARKED_MAX",
        "QEMUs of snapshot-paused VMs a node keeps stopped (RAM handed back) so that their"
        " resume continues them instead of starting a new QEMU; `0` turns it off",
        lo=0,
    )
    parked_secs: float = setting(
        900.0, "PAL_PARKED_SECS", "how long a node keeps such a parked QEMU at most, seconds", lo=1.0
    )
    prestart: tuple[tuple[str, int], ...] = setting(
        sizes.DEFAULT_PRESTART,
        "PAL_PRESTART",
        "QEMUs a node keeps started and waiting for an incoming migration (`-incoming defer`),"
        " their jail, cgroup and network namespace made, per size, for a resume into a new"
        " QEMU or a fork child of that size to take (`256m-1c-2048d:4`); `0` turns it off",
        read=lambda _n, raw: parse_pool(raw, sizes.DEFAULT_PRESTART, "PAL_PRESTART"),
        shown="`256m-1c-2048d:4`",
    )
    metrics_interval_s: float = setting(
        5.0, "PAL_METRICS_INTERVAL", "per-VM metrics sample period, seconds (15 minutes are kept)", lo=0.5
    )
    dashboard_secret: str | None = setting(
        None,
        "PAL_DASHBOARD_SECRET",
        "signs dashboard sessions and port links (replicas must share it)",
        shown="random, in `<data dir>/dashboard.key`; `pal server`: derived from `PAL_CLUSTER_SECRET`",
    )
    metrics_token: str | None = setting(
        None,
        "PAL_METRICS_TOKEN",
        "a second bearer token that opens `/metrics` (and the health details) alone, for a"
        " scraper; the operator token opens it too",
    )
    egress_default: Egress = setting(
        "open",
        "PAL_EGRESS_DEFAULT",
        "egress of a VM whose spec has none: `open`, `none` or a JSON allow/deny object",
        read=lambda _n, raw: parse_egress_default(raw),
    )
    egress_allow_internal: list[str] = setting(
        [],
        "PAL_EGRESS_ALLOW_INTERNAL",
        "internal addresses/CIDRs (optionally `:port`) guests may reach, e.g. `10.0.5.0/24:5432`",
    )
    egress_resolve: str | None = setting(
        None, "PAL_EGRESS_RESOLVE", "`name=ip,...`: fixed DNS answers for guests (like curl `--resolve`)"
    )
    cors_origins: list[str] = setting(
        [],
        "PAL_CORS_ORIGINS",
        "`https://app.example,...`: browser origins allowed to call the API with a key (the"
        " TypeScript SDK in a web page); no cookies cross origins",
    )
    ports_port: int | None = setting(
        None,
        "PAL_PORTS_PORT",
        "the ports listener (`--ports-port`): each VM port has an origin of its own there,"
        " `http://{port}-{vmId}.localhost:8082` (docs/ports.md, pal/api/port_origins.py);"
        " it serves nothing else. Unset: the API's port + 2, or a free port when that one is"
        " taken (`pal up` prints it)",
        read=read_ports_port,
        shown="`--port` + 2 (`8082`)",
    )
    e2b_port: int = setting(49983, "PAL_E2B_PORT", E2B_PORT_DOC, read=read_e2b_port)
    e2b_idle_timeout_s: int = setting(0, "PAL_E2B_IDLE_TIMEOUT", config_env.E2B_IDLE_DOC)
    ports_domain: str | None = setting(
        None,
        "PAL_PORTS_DOMAIN",
        "`ports.example.com` (https) or `http(s)://name[:port]`: port links name"
        " `{port}-{vmId}.<domain>`, for a wildcard DNS name and certificate in front of Pal",
        shown="unset (`*.localhost`)",
    )
    egress_host_dns: bool = setting(
        True,
        "PAL_EGRESS_DNS",
        "`host`: other names through the host's resolver; `static`: only"
        " `PAL_EGRESS_RESOLVE`'s names resolve, no lookup leaves the node (an air-gapped"
        " node; the tests)",
        read=read_egress_dns,
        shown="`host`",
    )
    egress_nameservers: str | None = setting(
        None,
        "PAL_EGRESS_NAMESERVERS",
        "`ip[:port],...`: the name servers the egress gateway asks (asynchronously, 2 s per"
        " try, 5 s per lookup)",
        read=read_nameservers,
        shown="`/etc/resolv.conf`'s",
    )
    max_connections: int = setting(
        4096,
        "PAL_MAX_CONNECTIONS",
        "ceiling of a spec's `limits.maxConnections` (above: 400 naming the field; a spec that"
        " does not say gets at most this)",
        read=read_at_least(1),
    )
    max_buffer_bytes: int = setting(
        64 << 20,
        "PAL_MAX_BUFFER_BYTES",
        "ceiling of a spec's `waitPause.maxBufferBytes`, also the hold buffer of a VM without"
        " `waitPause` when lower than 16 MiB",
        read=read_at_least(64 * 1024),
        shown="`67108864` (64 MiB)",
    )
    max_egress_mbps: int | None = setting(
        None,
        "PAL_MAX_EGRESS_MBPS",
        "ceiling of a spec's `limits.egressMbps`, and the rate of a VM that asks none; unset: no ceiling",
        read=read_at_least(1),
    )
    disk_read_mibps: int | None = setting(
        DEFAULT_DISK_READ_MIBPS,
        "PAL_DISK_READ_MIBPS",
        "disk read bandwidth of a VM whose spec asks none (`limits.diskReadMibps`), MiB/s; `off`:"
        " unbounded. Held by QEMU and by the kernel's throttle (`pal doctor` says where)",
        read=read_bound_or_off,
    )
    disk_write_mibps: int | None = setting(
        DEFAULT_DISK_WRITE_MIBPS,
        "PAL_DISK_WRITE_MIBPS",
        "disk write bandwidth of a VM whose spec asks none (`limits.diskWriteMibps`), MiB/s;"
        " `off`: unbounded",
        read=read_bound_or_off,
    )
    disk_iops: int | None = setting(
        DEFAULT_DISK_IOPS,
        "PAL_DISK_IOPS",
        "disk operations per second (reads and writes) of a VM whose spec asks none"
        " (`limits.diskIops`); `off`: unbounded",
        read=read_bound_or_off,
    )
    max_disk_read_mibps: int | None = setting(
        None,
        "PAL_MAX_DISK_READ_MIBPS",
        "ceiling of a spec's `limits.diskReadMibps` (above: 400 naming the field); a default"
        " above it is lowered to it; unset: no ceiling",
        read=read_at_least(1),
    )
    max_disk_write_mibps: int | None = setting(
        None,
        "PAL_MAX_DISK_WRITE_MIBPS",
        "ceiling of a spec's `limits.diskWriteMibps`, as PAL_MAX_DISK_READ_MIBPS",
        read=read_at_least(1),
    )
    max_disk_iops: int | None = setting(
        None,
        "PAL_MAX_DISK_IOPS",
        "ceiling of a spec's `limits.diskIops`, as PAL_MAX_DISK_READ_MIBPS",
        read=read_at_least(1),
    )
    gateway_max_buffer_bytes: int = setting(
        1 << 30,
        "PAL_GATEWAY_MAX_BUFFER_BYTES",
        "node total of bytes the egress gateway buffers for all VMs (each VM keeps its first"
        " 1 MiB); past it, backpressure",
        read=read_at_least(1 << 20),
        shown="`1073741824` (1 GiB)",
    )
    gateway_max_connections: int | None = setting(
        None,
        "PAL_GATEWAY_MAX_CONNECTIONS",
        "node total of guest connections (each VM keeps its first 32); past it, new ones are"
        " reset with an event",
        read=read_at_least(1),
        shown="what the gateway's descriptor limit allows",
    )
    wait_pause_default: WaitPause | None = setting(
        None,
        "PAL_WAIT_PAUSE",
        "`waitPause` of a VM whose spec has none: `off`, `on` (defaults) or a JSON object"
        ' (`{"afterMs": 500, "offloadAfterMs": 5000, "deliver": "first-byte",'
        ' "maxBufferBytes": 16777216}`)',
        read=lambda _n, raw: parse_wait_pause_default(raw),
        shown="`off`",
    )
    xfs_image_size_gib: int = setting(
        64,
        "PAL_XFS_IMAGE_GIB",
        "size of the loop-mounted XFS made when the data dir cannot reflink"
        " (`pal data-dir umount` takes it down; `pal up` does not)",
    )
    cgroups: bool = setting(
        True,
        "PAL_CGROUPS",
        "`off` lets VMs run without host CPU/memory/pids/IO limits; by default a VM whose"
        " limits cannot be applied does not start (503)",
        read=read_switch("required"),
        shown="`required`",
    )
    seccomp: bool = setting(
        True,
        "PAL_SECCOMP",
        "`off` runs QEMU without its seccomp filter (`-sandbox`, logged and shown by `pal"
        " doctor`); by default a QEMU built without `-sandbox` starts no VM (503)",
        read=read_switch("required"),
        shown="`required`",
    )
    exec_buffer_mib: int = setting(
        64,
        "PAL_EXEC_BUFFER_MIB",
        "output (MiB of characters) a tenant's buffered, non-streamed execs may hold at once"
        " on an API server (pal/api/exec_budget.py): a new one past it is 429"
        " `RESOURCE_EXHAUSTED`, a running one is cut (`truncated: true`)",
        lo=1,
    )
    # -- fair shares of what tenants share (docs/security.md, "Fair shares") --
    node_max_streams: int = setting(
        1024,
        "PAL_NODE_MAX_STREAMS",
        "long-lived calls (execs, output streams and attaches, long polls, cells, port"
        " connections) an API server holds open to one node at once, on connections of their"
        " own (control calls such as heartbeats, spawns, snapshots and stops keep theirs); a"
        " new one past it is 429 `RESOURCE_EXHAUSTED`",
        lo=1,
    )
    tenant_max_streams: int = setting(
        128,
        "PAL_TENANT_MAX_STREAMS",
        "long-lived calls one tenant may hold at once on an API server (as above); a new one"
        " past it is 429 `RESOURCE_EXHAUSTED`, so no tenant can take what the others need",
        lo=1,
    )
    vm_max_streams: int = setting(
        32,
        "PAL_VM_MAX_STREAMS",
        "long-lived calls open at once on one VM (as above); past it 429 `RESOURCE_EXHAUSTED`",
        lo=1,
    )
    slow_reader_secs: float = setting(
        30.0,
        "PAL_SLOW_READER_SECS",
        "a reader that takes none of its stream's output for this long, once the guest has sent"
        " all its stream may send ahead (1 MiB), is detached (`detached {reason: slow-reader}`:"
        " the process runs on, its output stays in its journal; a cell is interrupted)",
        lo=1.0,
    )
    audit_events_per_vm: int = setting(
        1000,
        "PAL_AUDIT_EVENTS_PER_VM",
        "client audit events (`mcp_tool`) kept per VM: the oldest go as new ones come",
        lo=10,
    )
    audit_rate: float = setting(
        20.0,
        "PAL_AUDIT_RATE",
        "client audit events (`POST .../audit`) a tenant may write per second on an API server,"
        " in bursts of up to 10 s worth; past it 429 `RESOURCE_EXHAUSTED` with `Retry-After`",
        lo=0.1,
    )
    hosts: list[str] = setting(
        [],
        "PAL_HOSTS",
        "`pal.example.com,...`: the names the API and dashboard answer as (the `Host`"
        " header), besides `localhost`, the loopback addresses and the listen/advertised"
        " address; any other name gets 421 (DNS rebinding)",
    )
    image_max_gib: int = setting(
        16, "PAL_IMAGE_MAX_GIB", "largest image `pal image import` / `pal image build -f` accepts", lo=1
    )
    s3_endpoint: str | None = setting(
        None,
        "S3_ENDPOINT",
        "S3 / MinIO endpoint snapshots are mirrored to, with `S3_BUCKET` (a cluster needs"
        " it: snapshots move between nodes through it)",
    )
    s3_bucket: str | None = setting(None, "S3_BUCKET", "the bucket of `S3_ENDPOINT`")
    snapshot_encryption: bool = setting(
        True,
        "PAL_SNAPSHOT_ENCRYPTION",
        "snapshots are encrypted on the node before they go to S3 (docs/security.md,"
        ' "Snapshots at rest"); `off` uploads them in the clear (encrypted ones still restore)',
        read=read_switch("on"),
        shown="`on`",
    )
    snapshot_encryption_key_file: Path | None = setting(
        None,
        "PAL_SNAPSHOT_ENCRYPTION_KEY_FILE",
        "key wrapping each snapshot's data key in S3 (made on first use, 0600; give every"
        " node of a bucket the same file; rotate with `pal snapshots rekey`)",
        shown=_KEYS + "snapshot-encryption.key`",
    )
    s3_sse: str | None = setting(
        None,
        "PAL_S3_SSE",
        "S3 server-side encryption asked for on every object: `AES256` or `aws:kms`;"
        " besides or instead of Pal's own",
        read=lambda name, raw: read_s3_sse(name, raw, S3_SSE_MODES),
    )
    s3_sse_kms_key_id: str | None = setting(
        None, "PAL_S3_SSE_KMS_KEY_ID", "the KMS key of `PAL_S3_SSE=aws:kms` (unset: the bucket's default)"
    )
    # -- cluster (docs/deploy.md) --
    database_url: str | None = setting(
        None, "PAL_DATABASE_URL", "PostgreSQL (`--database`); unset: SQLite in the data dir (`pal up`)"
    )
    cluster_secret: str | None = setting(
        None, "PAL_CLUSTER_SECRET", "control plane: node tokens derive from it (`pal node token NODE`)"
    )
    admin_token: str | None = setting(
        None,
        "PAL_ADMIN_TOKEN",
        "the operator token (pal/operator.py): operator routes (`pal node ls/drain/activate`),"
        " `/metrics`, the `/healthz` and `/readyz` details; no caller is the operator by its"
        " address",
        shown=_KEYS + "operator.token` (`pal up`, made at first start, 0600); `pal server`:"
        " derived from `PAL_CLUSTER_SECRET`",
    )
    leader_lease_s: float = setting(
        5.0,
        "PAL_LEADER_LEASE",
        "leadership lease, seconds (a killed leader is replaced within about this long)",
        lo=1.0,
    )
    node_token: str | None = setting(
        None, "PAL_NODE_TOKEN", "node: its token (printed by `pal node token NODE` where the secret is)"
    )
    node_name: str | None = setting(None, "PAL_NODE_NAME", "node: its id (`--name`)", shown="host name")
    node_region: str = setting("", "PAL_NODE_REGION", "node: its region (`--region`)", shown="none")
    node_labels: dict[str, str] = setting(
        {},
        "PAL_NODE_LABELS",
        "node: `k=v,...` labels for placement",
        read=lambda _n, raw: parse_labels(raw),
        shown="none",
    )
    node_memory_mib: int = setting(
        0,
        "PAL_NODE_MEMORY_MIB",
        "guest RAM (MiB) a node hands out (placement's capacity); `0`: host RAM - 1 GiB",
        lo=0,
        shown="host RAM - 1 GiB",
    )
    servers: list[str] = setting([], "PAL_SERVERS", "node: control-plane URLs it heartbeats to (`--server`)")
    node_heartbeat_interval_s: float = setting(
        5.0, "PAL_NODE_HEARTBEAT_INTERVAL", "node heartbeat period, seconds", lo=0.5
    )
    node_lost_after_s: float = setting(
        30.0, "PAL_NODE_LOST_AFTER", "a node silent this long (seconds) has lost its running VMs", lo=2.0
    )
    event_retention_days: float = setting(
        90.0,
        "PAL_EVENT_RETENTION_DAYS",
        "VM events (status changes and audits) older than this many days are deleted by the leader",
        lo=1.0,
    )
    egress_ca_bundle: Path | None = setting(
        None,
        "PAL_EGRESS_CA_BUNDLE",
        "PEM file of CAs the egress gateway trusts (besides the system store) when it"
        " connects upstream for a brokered secret (a private or test CA)",
    )
    snapshot_key_file: Path | None = setting(
        None,
        "PAL_SNAPSHOT_KEY_FILE",
        "HMAC key authenticating snapshot `meta.json` (made on first use; give every node of"
        " a cluster and its control plane the same file)",
        shown=_KEYS + "snapshot.key`",
    )
    secrets_key_file: Path | None = setting(
        None,
        "PAL_SECRETS_KEY_FILE",
        "key sealing every VM secret in the store (made on first use, 0600; every"
        " control-plane replica needs the same file)",
        shown=_KEYS + "secrets.key`",
    )
    log_level: str = setting(
        "INFO", "PAL_LOG_LEVEL", "the server's log level", read=lambda _n, raw: raw.upper()
    )
    failpoint: str = setting(
        "",
        "PAL_FAILPOINT",
        "tests only: the server kills itself at this named step, or at its n-th hit with"
        " `name@n` (`pal/failpoints.py`)",
    )
    s3_region: str = setting(
        "us-east-1",
        "AWS_DEFAULT_REGION",
        "S3 region (credentials: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, read by boto3)",
    )

    @field_validator("*", mode="after")
    @classmethod
    def _within_bounds(cls, value: Any, info: Any) -> Any:
        return clamp(cls.model_fields[info.field_name], value)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, *_: Any, **__: Any
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, EnvSource(settings_cls))

    @classmethod
    def from_env(cls, data_dir: Path | str | None = None) -> Settings:
        """The settings of the environment; ``data_dir`` (``--data-dir``) over PAL_DATA_DIR."""
        with reading_env():
            given: dict[str, Any] = {"data_dir": Path(data_dir)} if data_dir else {}
            return cls(**given)

    @property
    def snapshots_root(self) -> Path:
        return self.snapshot_dir or (self.data_dir / "snapshots")

    @property
    def volumes_root(self) -> Path:
        """Where volumes live: PAL_VOLUMES_DIR (shared by the cluster's nodes), else the node's own."""
        return self.volumes_dir or (self.data_dir / "volumes")

    @property
    def volumes_shared(self) -> bool:
        """Volumes live on a file system every node reaches: no home node (docs/volumes.md)."""
        return self.volumes_dir is not None

    @property
    def images_dir(self) -> Path:
        return self.data_dir / "images"

    @property
    def vms_dir(self) -> Path:
        return self.data_dir / "vms"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "pal.db"

    @property
    def keys_dir(self) -> Path:
        return self.data_dir / "keys"

    @property
    def snapshot_key_path(self) -> Path:
        return self.snapshot_key_file or (self.keys_dir / "snapshot.key")

    @property
    def snapshot_encryption_key_path(self) -> Path:
        return self.snapshot_encryption_key_file or (self.keys_dir / "snapshot-encryption.key")

    @property
    def secrets_key_path(self) -> Path:
        return self.secrets_key_file or (self.keys_dir / "secrets.key")

    @property
    def manager_socket(self) -> Path:
        return self.data_dir / "run" / "manager.sock"

    @property
    def s3_enabled(self) -> bool:
        return bool(self.s3_endpoint and self.s3_bucket)

    @property
    def disk_bounds(self) -> DiskBounds:
        return DiskBounds(
            read_mibps=(self.disk_read_mibps, self.max_disk_read_mibps),
            write_mibps=(self.disk_write_mibps, self.max_disk_write_mibps),
            iops=(self.disk_iops, self.max_disk_iops),
        )

    @property
    def net_budgets(self) -> NetBudgets:
        return NetBudgets(
            max_connections=self.max_connections,
            max_buffer_bytes=self.max_buffer_bytes,
            max_egress_mbps=self.max_egress_mbps,
            node_buffer_bytes=self.gateway_max_buffer_bytes,
            node_connections=self.gateway_max_connections,
            nameservers=self.egress_nameservers,
        )


@dataclass(frozen=True)
class NetBudgets:
    """The ceilings on what a spec may ask of the network (checked at schedule: a 400 that
    names the field; pal/scheduler/ceilings.py) and the egress gateway's node totals
    (pal/network/budgets.py), as the settings above give them."""

    max_connections: int = 4096
    max_buffer_bytes: int = 64 << 20
    max_egress_mbps: int | None = None  # also the rate of a VM that asks none
    node_buffer_bytes: int = 1 << 30
    node_connections: int | None = None  # None: what the descriptor limit allows
    nameservers: str | None = None  # None: resolv.conf's

    def gateway_json(self) -> dict[str, object]:
        """What the egress gateway takes (its ``configure`` message)."""
        return {
            "nameservers": self.nameservers,
            "nodeBufferBytes": self.node_buffer_bytes,
            "nodeConnections": self.node_connections,
            "maxBufferBytes": self.max_buffer_bytes,
        }


@dataclass(frozen=True)
class DiskBounds:
    """Per kind of disk limit: (the default of a VM whose spec asks none, the ceiling of
    what a spec may ask); None: unbounded / no ceiling (pal/scheduler/ceilings.py)."""

    read_mibps: tuple[int | None, int | None] = (None, None)
    write_mibps: tuple[int | None, int | None] = (None, None)
    iops: tuple[int | None, int | None] = (None, None)


def _one(field: str) -> Any:
    """One setting from the environment, by its declaration (for a process without Settings)."""
    from pal.config_env import read_field

    return read_field(Settings.model_fields[field], Settings.model_fields[field].default)


def env_log_level() -> str:
    """PAL_LOG_LEVEL, also for the processes Pal starts (the egress gateway)."""
    return str(_one("log_level"))


def armed_failpoint() -> str:
    """PAL_FAILPOINT: the crash point armed in this process (tests only; see failpoints.py)."""
    return str(_one("failpoint"))


if __name__ == "__main__":
    from pal.config_env import main

    raise SystemExit(main(Settings, Path(__file__).resolve().parents[1] / "README.md"))
