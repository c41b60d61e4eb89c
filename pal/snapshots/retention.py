"""Which snapshots of one VM to delete: keep the newest few, drop the old, spare protected.

The decision is a pure function of the snapshots' creation times, the protected set and
"now", so it is unit-tested with a fake clock; the store applies it to each tier.

Rules (spec "Where snapshots are stored"): per (agent_version_id, vm_id) the newest
``KEEP_NEWEST`` are kept and anything older than ``MAX_AGE_S`` is deleted. We read the
two as independent: a snapshot goes when it is not among the newest 3 OR when it is older
than 7 days, so a VM stopped for a week leaves nothing behind. A protected snapshot (the
one a paused VM resumes from, one whose mem a live fork maps) is never deleted; when it is
among the newest 3 it takes one of their places, when older it is kept on top of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from datetime import datetime

KEEP_NEWEST = 3
MAX_AGE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class SnapshotAge:
    snapshot_id: str
    created_unix: float


def created_unix(meta: Mapping[str, object]) -> float | None:
    """Creation time of a snapshot from its meta (``createdAt``, ISO-8601 UTC)."""
    raw = meta.get("createdAt")
    if not isinstance(raw, str):
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def to_delete(
    snapshots: Iterable[SnapshotAge],
    protected: Set[str],
    now: float,
    *,
    keep_newest: int = KEEP_NEWEST,
    max_age_s: float = MAX_AGE_S,
) -> list[str]:
    """Ids to delete, oldest first. Ties in time are broken by id so the result is stable."""
    ordered = sorted(snapshots, key=lambda s: (s.created_unix, s.snapshot_id), reverse=True)
    doomed: list[str] = []
    for rank, snap in enumerate(ordered):
        if snap.snapshot_id in protected:
            continue
        too_many = rank >= keep_newest
        too_old = now - snap.created_unix > max_age_s
        if too_many or too_old:
            doomed.append(snap.snapshot_id)
    doomed.reverse()
    return doomed


def ages_from_metas(metas: Iterable[Mapping[str, object]], fallback_unix: float) -> list[SnapshotAge]:
    """Turn metas into ages; a meta without a readable ``createdAt`` gets ``fallback_unix``
    (e.g. the file's mtime) rather than being treated as infinitely old."""
    out: list[SnapshotAge] = []
    for meta in metas:
        sid = meta.get("snapshotId")
        if not isinstance(sid, str):
            continue
        ts = created_unix(meta)
        out.append(SnapshotAge(sid, ts if ts is not None else fallback_unix))
    return out
