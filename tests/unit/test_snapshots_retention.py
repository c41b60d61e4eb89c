"""Retention decisions (pure function, fake clock)."""

from __future__ import annotations

from pal.snapshots.retention import MAX_AGE_S, SnapshotAge, created_unix, to_delete

NOW = 1_800_000_000.0
DAY = 24 * 3600.0


def _snaps(*ages_days: float) -> list[SnapshotAge]:
    return [SnapshotAge(f"s{i}", NOW - age * DAY) for i, age in enumerate(ages_days)]


def test_keeps_newest_three_and_deletes_older_ones_oldest_first() -> None:
    # s0 newest ... s4 oldest, all recent
    assert to_delete(_snaps(0.1, 0.2, 0.3, 0.4, 0.5), set(), NOW) == ["s4", "s3"]


def test_three_or_fewer_recent_snapshots_are_all_kept() -> None:
    assert to_delete(_snaps(0.1, 1, 6.9), set(), NOW) == []


def test_anything_older_than_seven_days_goes_even_among_the_newest_three() -> None:
    assert to_delete(_snaps(1, 7.5, 30), set(), NOW) == ["s2", "s1"]
    just_inside = [SnapshotAge("edge", NOW - MAX_AGE_S)]
    assert to_delete(just_inside, set(), NOW) == []


def test_protected_snapshots_survive_both_rules_and_count_as_newest() -> None:
    snaps = _snaps(0.1, 0.2, 0.3, 0.4, 10)
    # s4 is old and outside the newest 3, s3 is outside the newest 3: both protected
    assert to_delete(snaps, {"s3", "s4"}, NOW) == []
    # protecting s0 does not free a slot for s3
    assert to_delete(snaps, {"s0"}, NOW) == ["s4", "s3"]


def test_same_timestamp_is_ordered_by_id() -> None:
    snaps = [SnapshotAge(sid, NOW) for sid in ("a", "b", "c", "d")]
    assert to_delete(snaps, set(), NOW) == ["a"]


def test_created_at_parsing() -> None:
    assert created_unix({"createdAt": "2027-01-15T08:00:00Z"}) == 1800000000.0
    assert created_unix({"createdAt": "garbage"}) is None
    assert created_unix({}) is None
