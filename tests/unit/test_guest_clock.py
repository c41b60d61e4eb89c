"""The host's correction of a guest's clock from the guest's answer (pal/manager/guest_clock.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from pal.guest import protocol as p
from pal.manager import guest_clock

MS = 1_000_000


def test_the_lag_is_the_hosts_clock_on_arrival_less_the_guests_in_its_answer() -> None:
    assert guest_clock.lag_ns({"wall_ns": 1_000 * MS}, 1_110 * MS) == 110 * MS


def test_nothing_is_corrected_without_a_real_lag() -> None:
    now = 5_000 * MS
    assert guest_clock.lag_ns({}, now) is None  # an older harness sends no clock
    assert guest_clock.lag_ns({"wall_ns": "1"}, now) is None
    assert guest_clock.lag_ns({"wall_ns": True}, now) is None
    assert guest_clock.lag_ns({"wall_ns": now}, now) is None
    assert guest_clock.lag_ns({"wall_ns": now - guest_clock.SLACK_NS}, now) is None  # within the trip
    assert guest_clock.lag_ns({"wall_ns": now + 50 * MS}, now) is None  # ahead: never set back
    # a guest claiming to be a minute behind is no late reader (a hostile one only hurts itself,
    # but the host does not follow it)
    assert guest_clock.lag_ns({"wall_ns": now - p.MAX_CLOCK_ADJUST_NS - 1}, now) is None


class _Channel:
    vm_id = "vm-1"

    def __init__(self) -> None:
        self.posted: list[dict[str, Any]] = []

    async def post(self, msg: dict[str, Any]) -> None:
        self.posted.append(msg)


def test_the_correction_is_posted_as_a_relative_clock_message() -> None:
    ch = _Channel()
    got = asyncio.run(guest_clock.correct(ch, {"wall_ns": 100 * MS}, 230 * MS))  # type: ignore[arg-type]
    assert got == 130 * MS
    assert ch.posted == [{"k": p.K_CLOCK, "adjust_ns": 130 * MS}]
    assert asyncio.run(guest_clock.correct(ch, {"wall_ns": 230 * MS}, 230 * MS)) == 0  # type: ignore[arg-type]
    assert len(ch.posted) == 1
