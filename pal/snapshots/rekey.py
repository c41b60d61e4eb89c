"""Rotating the snapshot encryption key: rewrap every data key in the bucket (crypt.py).

Only the small ``key.json`` objects are rewritten; the data objects stay as they are, since
their data keys do not change. Idempotent and safe to re-run: a key.json already wrapped
under the new key is left alone, so a rotation interrupted half-way is finished by running
it again, and one run after every node holds the new key catches the snapshots uploaded
under the old key meanwhile (docs/security.md, "Snapshots at rest").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pal.snapshots import crypt
from pal.snapshots.layout import ENCRYPTION_META_FIELD, KEY_FILE, META_FILE, SnapshotRef
from pal.snapshots.s3 import S3Mirror


@dataclass
class RekeyReport:
    rewrapped: list[str] = field(default_factory=list)
    already_new: list[str] = field(default_factory=list)
    # Complete snapshots uploaded unencrypted (before encryption, or with it off).
    unencrypted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "rewrapped": len(self.rewrapped),
            "alreadyNewKey": len(self.already_new),
            "unencrypted": sorted(self.unencrypted),
            "failed": dict(sorted(self.failed.items())),
        }


def _name(ref: SnapshotRef) -> str:
    return crypt.snapshot_identity(ref)


def rekey(mirror: S3Mirror, old_key: bytes, new_key: bytes, log: logging.Logger | None = None) -> RekeyReport:
    """Rewrap the data key of every snapshot in the mirror's bucket from ``old_key`` to
    ``new_key``. A key.json under neither key, or that does not open, is reported in
    ``failed`` and left untouched."""
    log = log or logging.getLogger("pal.snapshots.rekey")
    old_id, new_id = crypt.key_id(old_key), crypt.key_id(new_key)
    report = RekeyReport()
    for ref, names in sorted(mirror.snapshot_objects().items(), key=lambda kv: _name(kv[0])):
        if KEY_FILE not in names:
            if META_FILE in names:
                _classify_plain(mirror, ref, report)
            continue
        body = mirror.read_key_object(ref)
        if body is None:
            continue  # deleted since the listing
        try:
            kid = crypt.wrapped_key_id(body, ref)
            if kid == new_id:
                crypt.unwrap(body, new_key, ref)  # it must also open, not only say so
                report.already_new.append(_name(ref))
                continue
            if kid != old_id:
                raise crypt.SnapshotUnreadable(f"wrapped under key {kid}, neither {old_id} nor {new_id}")
            mirror.write_key_object(ref, crypt.rewrap(body, old_key, new_key, ref))
        except crypt.SnapshotUnreadable as exc:
            report.failed[_name(ref)] = exc.message
            log.error("cannot rewrap the data key of %s: %s", _name(ref), exc.message)
            continue
        report.rewrapped.append(_name(ref))
    log.info(
        "rewrapped %d data key(s) from key %s to %s (%d already under it, %d failed)",
        len(report.rewrapped),
        old_id,
        new_id,
        len(report.already_new),
        len(report.failed),
    )
    return report


def _classify_plain(mirror: S3Mirror, ref: SnapshotRef, report: RekeyReport) -> None:
    """A complete snapshot without key.json: unencrypted, or an encrypted one that lost it."""
    try:
        meta = mirror.read_meta(ref)
    except Exception as exc:
        report.failed[_name(ref)] = f"meta.json unreadable: {exc}"
        return
    if meta is None:
        return
    if meta.get(ENCRYPTION_META_FIELD) is not None:
        report.failed[_name(ref)] = "encrypted, but its key.json is missing"
    else:
        report.unencrypted.append(_name(ref))
