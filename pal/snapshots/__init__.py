"""Snapshot store: local tier, S3 mirror, retention, ownership (used by the manager only)."""

from pal.snapshots.layout import SnapshotRef
from pal.snapshots.s3 import S3Mirror
from pal.snapshots.store import SnapshotStore

__all__ = ["S3Mirror", "SnapshotRef", "SnapshotStore"]
