"""Settings read from the environment (and CLI flags), in one place.

Every environment variable Pal honours is read here, so `pal doctor` and the docs
can list them from one source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DATA_DIR = Path("/var/lib/pal")
FORK_COUNT_CEILING = 1000


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


@dataclass
class Settings:
    data_dir: Path = DEFAULT_DATA_DIR
    snapshot_dir: Path | None = None  # SNAPSHOT_DIR; default <data_dir>/snapshots
    accel: str = "auto"  # PAL_ACCEL: auto | kvm | tcg
    max_fork_count: int = 100  # PAL_MAX_FORK_COUNT, clamped to FORK_COUNT_CEILING
    fork_concurrency: int = 16  # PAL_FORK_CONCURRENCY
    harness_ready_timeout_ms: int = 5000  # PAL_HARNESS_READY_TIMEOUT_MS
    idle_sweep_interval_s: float = 10.0  # PAL_IDLE_SWEEP_INTERVAL (DefaultIdleSweepInterval)
    heartbeat_interval_s: float = 5.0  # harness heartbeat period
    s3_endpoint: str | None = None  # S3_ENDPOINT
    s3_bucket: str | None = None  # S3_BUCKET
    s3_region: str = "us-east-1"  # AWS_DEFAULT_REGION
    xfs_image_size_gib: int = 64  # PAL_XFS_IMAGE_GIB: loop XFS for a non-reflink data dir
    templates: bool = True  # PAL_TEMPLATES=0 disables warm templates (always cold boot)
    extra: dict[str, str] = field(default_factory=dict)

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
            xfs_image_size_gib=_int_env("PAL_XFS_IMAGE_GIB", 64),
            templates=os.environ.get("PAL_TEMPLATES", "1") not in ("0", "false", "no"),
        )
