"""Settings read from the environment (and CLI flags), in one place.

Every environment variable the server side honours is read here (README, "Configuration",
lists them). The client side's PAL_URL and PAL_API_KEY are read by the SDK itself
(pal/sdk/_wire.py), which imports nothing else from pal; the tests' PAL_TEST_DATA_DIR by
tests/conftest.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pal import sizes
from pal.spec import MAX_EXEC_TIMEOUT_S, Egress, WaitPause, parse_egress_default, parse_wait_pause_default

DEFAULT_DATA_DIR = Path("/var/lib/pal")
# The ports listener (VM ports on origins of their own): beside the API's 8080 and a
# node RPC's 8081 (a node may run on the same machine).
DEFAULT_PORTS_PORT = 8082


def env_log_level() -> str:
    """PAL_LOG_LEVEL, also for the processes Pal starts (the egress gateway)."""
    return (os.environ.get("PAL_LOG_LEVEL") or "INFO").upper()


def armed_failpoint() -> str:
    """PAL_FAILPOINT: the crash point armed in this process (tests only; see failpoints.py)."""
    return os.environ.get("PAL_FAILPOINT", "")


FORK_COUNT_CEILING = 1000
# A buffered exec without timeoutSecs is killed after this long (PAL_EXEC_DEFAULT_TIMEOUT):
# a command that never ends (waiting on a fifo, a prompt) must not hold a request open until
# the VM is deleted. Streamed exec has no default: its reader sees the output and can stop it.
EXEC_DEFAULT_TIMEOUT_S = 300.0


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {raw!r}") from exc


def parse_labels(raw: str | list[str]) -> dict[str, str]:
    """``"k=v,k2=v2"`` (or a list of ``k=v``) as a dict; ValueError on a malformed item."""
    items = raw if isinstance(raw, list) else [x for x in raw.split(",")]
    out: dict[str, str] = {}
    for item in (x.strip() for x in items):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def parse_template_sizes(raw: str | None) -> tuple[str, ...] | None:
    """PAL_TEMPLATE_SIZES: ``256m-1c-2048d,512m-1c-2048d`` (None = any size: ``*``);
    unset or empty: the defaults of pal/sizes.py."""
    text = (raw or "").strip()
    if not text:
        return sizes.DEFAULT_TEMPLATE_SIZES
    if text == "*":
        return None
    out = []
    for item in (x.strip() for x in text.split(",")):
        if item:
            try:
                out.append(sizes.size_name(*sizes.parse_size_name(item)))
            except ValueError as exc:
                raise ValueError(f"PAL_TEMPLATE_SIZES: {exc}") from exc
    return tuple(out)


def _egress_dns_env() -> bool:
    raw = os.environ.get("PAL_EGRESS_DNS", "host").strip().lower() or "host"
    if raw not in ("host", "static"):
        raise ValueError(f"PAL_EGRESS_DNS must be 'host' or 'static', got {raw!r}")
    return raw == "host"


def _path_env(name: str) -> Path | None:
    raw = os.environ.get(name)
    return Path(raw) if raw and raw.strip() else None


def _seccomp_env() -> bool:
    raw = os.environ.get("PAL_SECCOMP", "required").strip().lower()
    if raw in ("required", "on", "1", "yes", "true", ""):
        return True
    if raw in ("off", "0", "no", "false"):
        return False
    raise ValueError(f"PAL_SECCOMP must be 'required' or 'off', got {raw!r}")


S3_SSE_MODES = ("AES256", "aws:kms")


def _s3_sse_env() -> str | None:
    raw = os.environ.get("PAL_S3_SSE", "").strip()
    if raw in ("", "off", "none"):
        return None
    if raw not in S3_SSE_MODES:
        raise ValueError(f"PAL_S3_SSE must be one of {', '.join(S3_SSE_MODES)} or off, got {raw!r}")
    return raw


def _snapshot_encryption_env() -> bool:
    raw = os.environ.get("PAL_SNAPSHOT_ENCRYPTION", "on").strip().lower()
    if raw in ("on", "1", "yes", "true", ""):
        return True
    if raw in ("off", "0", "no", "false"):
        return False
    raise ValueError(f"PAL_SNAPSHOT_ENCRYPTION must be 'on' or 'off', got {raw!r}")


def _cgroups_env() -> bool:
    raw = os.environ.get("PAL_CGROUPS", "required").strip().lower()
    if raw in ("required", "on", "1", "yes", "true", ""):
        return True
    if raw in ("off", "0", "no", "false"):
        return False
    raise ValueError(f"PAL_CGROUPS must be 'required' or 'off', got {raw!r}")


def _exec_default_timeout() -> float | None:
    secs = _float_env("PAL_EXEC_DEFAULT_TIMEOUT", EXEC_DEFAULT_TIMEOUT_S)
    if secs < 0:
        raise ValueError("PAL_EXEC_DEFAULT_TIMEOUT must be 0 (no default) or more")
    return min(secs, MAX_EXEC_TIMEOUT_S) if secs else None


def _ports_port_env() -> int:
    port = _int_env("PAL_PORTS_PORT", DEFAULT_PORTS_PORT)
    if not 1 <= port <= 65535:
        raise ValueError(f"PAL_PORTS_PORT must be a TCP port (1-65535), got {port}")
    return port


@dataclass
class Settings:
    data_dir: Path = DEFAULT_DATA_DIR
    snapshot_dir: Path | None = None  # SNAPSHOT_DIR; default <data_dir>/snapshots
    accel: str = "auto"  # PAL_ACCEL: auto | kvm | tcg
    max_fork_count: int = 100  # PAL_MAX_FORK_COUNT, clamped to FORK_COUNT_CEILING
    fork_concurrency: int = 16  # PAL_FORK_CONCURRENCY
    harness_ready_timeout_ms: int = 5000  # PAL_HARNESS_READY_TIMEOUT_MS
    idle_sweep_interval_s: float = 10.0  # PAL_IDLE_SWEEP_INTERVAL (DefaultIdleSweepInterval)
    heartbeat_interval_s: float = 5.0  # PAL_HEARTBEAT_INTERVAL: harness heartbeat period
    s3_endpoint: str | None = None  # S3_ENDPOINT
    s3_bucket: str | None = None  # S3_BUCKET
    s3_region: str = "us-east-1"  # AWS_DEFAULT_REGION
    # PAL_SNAPSHOT_ENCRYPTION=off: upload snapshots to S3 unencrypted (default on: encrypted
    # on the node before upload, docs/security.md "Snapshots at rest")
    snapshot_encryption: bool = True
    # PAL_S3_SSE=AES256|aws:kms: S3 server-side encryption asked for on every object written;
    # PAL_S3_SSE_KMS_KEY_ID: the KMS key of aws:kms (unset: the bucket's default)
    s3_sse: str | None = None
    s3_sse_kms_key_id: str | None = None
    xfs_image_size_gib: int = 64  # PAL_XFS_IMAGE_GIB: loop XFS for a non-reflink data dir
    templates: bool = True  # PAL_TEMPLATES=0 disables warm templates (always cold boot)
    # PAL_TEMPLATE_SIZES: sizes (256m-1c-2048d,...) that get a template on first use; * = any
    template_sizes: tuple[str, ...] | None = sizes.DEFAULT_TEMPLATE_SIZES
    template_builds: int = 1  # PAL_TEMPLATE_BUILDS: template builds at once (each boots a VM)
    templates_keep: int = 8  # PAL_TEMPLATES_KEEP: templates kept; the least recently used go
    # PAL_PARKED_MAX: QEMUs of snapshot-paused VMs kept stopped for a fast resume (0: off)
    parked_max: int = 8
    parked_secs: float = 900.0  # PAL_PARKED_SECS: how long one is kept at most
    metrics_interval_s: float = 5.0  # PAL_METRICS_INTERVAL: per-VM metrics sample period
    # PAL_METRICS_TOKEN: a second bearer token for GET /metrics alone (a scraper's); the
    # operator token (PAL_ADMIN_TOKEN, pal/operator.py) opens it too
    metrics_token: str | None = None
    # PAL_DASHBOARD_SECRET: signs dashboard sessions; unset = a random key kept in the data dir
    dashboard_secret: str | None = None
    egress_default: Egress = "open"  # PAL_EGRESS_DEFAULT: a VM's egress when its spec has none
    egress_resolve: str | None = None  # PAL_EGRESS_RESOLVE=name=ip,... (like curl --resolve)
    # PAL_EGRESS_DNS=host (default): other names through the host's resolver; static: only
    # PAL_EGRESS_RESOLVE's names resolve (an air-gapped node; the tests, which must never
    # send a lookup off the machine)
    egress_host_dns: bool = True
    # PAL_EGRESS_ALLOW_INTERNAL=cidr[:port],...: internal destinations the operator opens
    egress_allow_internal: list[str] = field(default_factory=list)
    # PAL_EGRESS_CA_BUNDLE: PEM file of CAs the gateway trusts (besides the system store) when
    # it connects upstream for a brokered secret (a private or test CA)
    egress_ca_bundle: Path | None = None
    image_max_gib: int = 16  # PAL_IMAGE_MAX_GIB: largest image `pal image import/build` accepts
    # PAL_CORS_ORIGINS=https://app.example,...: browser origins allowed to call the API
    cors_origins: list[str] = field(default_factory=list)
    # PAL_PORTS_PORT / --ports-port: the ports listener, where each VM port has an origin of
    # its own, http://{port}-{vm}.localhost:PORT (pal/api/port_origins.py)
    ports_port: int = DEFAULT_PORTS_PORT
    # PAL_PORTS_DOMAIN: ports.example.com (https) or http(s)://name[:port]: port links name
    # {port}-{vm}.<that>, for a wildcard DNS name and TLS in front; unset = *.localhost
    ports_domain: str | None = None
    # -- cluster (docs/deploy.md) --
    database_url: str | None = None  # PAL_DATABASE_URL / --database; unset = SQLite in the data dir
    # PAL_CLUSTER_SECRET (control plane): each node's token is derived from it (pal node token)
    cluster_secret: str | None = None
    node_token: str | None = None  # PAL_NODE_TOKEN (node): this node's token
    # PAL_ADMIN_TOKEN: the operator token (operator routes, /metrics, health details); unset =
    # <data dir>/keys/operator.token (pal up) or derived from PAL_CLUSTER_SECRET (pal server)
    admin_token: str | None = None
    # PAL_HOSTS=pal.example.com,...: the names the API and dashboard answer as (the Host
    # header; besides localhost, loopback addresses and the listen/advertised address)
    hosts: list[str] = field(default_factory=list)
    node_heartbeat_interval_s: float = 5.0  # PAL_NODE_HEARTBEAT_INTERVAL
    node_lost_after_s: float = 30.0  # PAL_NODE_LOST_AFTER: a node silent this long has lost its VMs
    leader_lease_s: float = 5.0  # PAL_LEADER_LEASE: failover comes within about this long
    node_name: str | None = None  # PAL_NODE_NAME / --name: this node's id (default: host name)
    node_region: str = ""  # PAL_NODE_REGION / --region
    node_labels: dict[str, str] = field(default_factory=dict)  # PAL_NODE_LABELS "k=v,k2=v2"
    node_memory_mib: int = 0  # PAL_NODE_MEMORY_MIB: guest RAM to hand out; 0 = host RAM - 1 GiB
    cgroups: bool = True  # PAL_CGROUPS=off: VMs run without host limits (else fail closed)
    seccomp: bool = True  # PAL_SECCOMP=off: QEMU runs without -sandbox (else fail closed)
    # PAL_EXEC_BUFFER_MIB: output a tenant's buffered (non-streamed) execs may hold at once
    # on an API server, in MiB of characters (pal/api/exec_budget.py)
    exec_buffer_mib: int = 64
    # PAL_WAIT_PAUSE: waitPause of a VM whose spec has none (None: off)
    wait_pause_default: WaitPause | None = None
    # PAL_EXEC_DEFAULT_TIMEOUT: seconds a buffered exec without timeoutSecs may run (0: none)
    exec_default_timeout_s: float | None = EXEC_DEFAULT_TIMEOUT_S

    # PAL_SNAPSHOT_KEY_FILE: HMAC key authenticating snapshot meta.json (share it across a
    # cluster's control plane and nodes); default <data_dir>/keys/snapshot.key, made on first use
    snapshot_key_file: Path | None = None
    # PAL_SECRETS_KEY_FILE: key encrypting secrets in the store (every control plane replica
    # needs the same one); default <data_dir>/keys/secrets.key, made on first use
    secrets_key_file: Path | None = None
    # PAL_SNAPSHOT_ENCRYPTION_KEY_FILE: key wrapping the data keys of snapshots in S3 (share
    # it across the nodes of a bucket); default <data_dir>/keys/snapshot-encryption.key
    snapshot_encryption_key_file: Path | None = None
    log_level: str = "INFO"  # PAL_LOG_LEVEL: the server's log level
    servers: list[str] = field(default_factory=list)  # PAL_SERVERS (node): control-plane URLs

    @property
    def snapshots_root(self) -> Path:
        return self.snapshot_dir or (self.data_dir / "snapshots")

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

    @classmethod
    def from_env(cls, data_dir: Path | str | None = None) -> Settings:
        dd = Path(data_dir or os.environ.get("PAL_DATA_DIR") or DEFAULT_DATA_DIR)
        snap = os.environ.get("SNAPSHOT_DIR")
        max_fork = _int_env("PAL_MAX_FORK_COUNT", 100)
        if max_fork < 1:
            raise ValueError("PAL_MAX_FORK_COUNT must be at least 1")
        return cls(
            data_dir=dd,
            snapshot_dir=Path(snap) if snap else None,
            accel=os.environ.get("PAL_ACCEL", "auto"),
            max_fork_count=min(max_fork, FORK_COUNT_CEILING),
            fork_concurrency=max(1, _int_env("PAL_FORK_CONCURRENCY", 16)),
            harness_ready_timeout_ms=_int_env("PAL_HARNESS_READY_TIMEOUT_MS", 5000),
            idle_sweep_interval_s=_float_env("PAL_IDLE_SWEEP_INTERVAL", 10.0),
            heartbeat_interval_s=_float_env("PAL_HEARTBEAT_INTERVAL", 5.0),
            s3_endpoint=os.environ.get("S3_ENDPOINT") or None,
            s3_bucket=os.environ.get("S3_BUCKET") or None,
            s3_region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            snapshot_encryption=_snapshot_encryption_env(),
            s3_sse=_s3_sse_env(),
            s3_sse_kms_key_id=os.environ.get("PAL_S3_SSE_KMS_KEY_ID") or None,
            xfs_image_size_gib=_int_env("PAL_XFS_IMAGE_GIB", 64),
            templates=os.environ.get("PAL_TEMPLATES", "1") not in ("0", "false", "no"),
            template_sizes=parse_template_sizes(os.environ.get("PAL_TEMPLATE_SIZES")),
            template_builds=max(1, _int_env("PAL_TEMPLATE_BUILDS", 1)),
            templates_keep=max(1, _int_env("PAL_TEMPLATES_KEEP", 8)),
            parked_max=max(0, _int_env("PAL_PARKED_MAX", 8)),
            parked_secs=max(1.0, _float_env("PAL_PARKED_SECS", 900.0)),
            metrics_interval_s=max(0.5, _float_env("PAL_METRICS_INTERVAL", 5.0)),
            metrics_token=os.environ.get("PAL_METRICS_TOKEN") or None,
            dashboard_secret=os.environ.get("PAL_DASHBOARD_SECRET") or None,
            egress_default=parse_egress_default(os.environ.get("PAL_EGRESS_DEFAULT")),
            egress_resolve=os.environ.get("PAL_EGRESS_RESOLVE") or None,
            egress_host_dns=_egress_dns_env(),
            egress_ca_bundle=Path(bundle) if (bundle := os.environ.get("PAL_EGRESS_CA_BUNDLE")) else None,
            egress_allow_internal=[
                p.strip() for p in os.environ.get("PAL_EGRESS_ALLOW_INTERNAL", "").split(",") if p.strip()
            ],
            image_max_gib=max(1, _int_env("PAL_IMAGE_MAX_GIB", 16)),
            cors_origins=[o.strip() for o in os.environ.get("PAL_CORS_ORIGINS", "").split(",") if o.strip()],
            ports_port=_ports_port_env(),
            ports_domain=os.environ.get("PAL_PORTS_DOMAIN") or None,
            database_url=os.environ.get("PAL_DATABASE_URL") or None,
            cluster_secret=os.environ.get("PAL_CLUSTER_SECRET") or None,
            node_token=os.environ.get("PAL_NODE_TOKEN") or None,
            admin_token=os.environ.get("PAL_ADMIN_TOKEN") or None,
            hosts=[h.strip() for h in os.environ.get("PAL_HOSTS", "").split(",") if h.strip()],
            node_heartbeat_interval_s=max(0.5, _float_env("PAL_NODE_HEARTBEAT_INTERVAL", 5.0)),
            node_lost_after_s=max(2.0, _float_env("PAL_NODE_LOST_AFTER", 30.0)),
            leader_lease_s=max(1.0, _float_env("PAL_LEADER_LEASE", 5.0)),
            node_name=os.environ.get("PAL_NODE_NAME") or None,
            node_region=os.environ.get("PAL_NODE_REGION", ""),
            node_labels=parse_labels(os.environ.get("PAL_NODE_LABELS", "")),
            node_memory_mib=max(0, _int_env("PAL_NODE_MEMORY_MIB", 0)),
            snapshot_key_file=_path_env("PAL_SNAPSHOT_KEY_FILE"),
            secrets_key_file=_path_env("PAL_SECRETS_KEY_FILE"),
            snapshot_encryption_key_file=_path_env("PAL_SNAPSHOT_ENCRYPTION_KEY_FILE"),
            cgroups=_cgroups_env(),
            seccomp=_seccomp_env(),
            exec_buffer_mib=max(1, _int_env("PAL_EXEC_BUFFER_MIB", 64)),
            wait_pause_default=parse_wait_pause_default(os.environ.get("PAL_WAIT_PAUSE")),
            exec_default_timeout_s=_exec_default_timeout(),
            log_level=env_log_level(),
            servers=[s.strip() for s in os.environ.get("PAL_SERVERS", "").split(",") if s.strip()],
        )
