"""The guest's wall clock after a restore, a fork or a live resume: the host's, to about
a millisecond.

A clock message (``identify``, ``clock``) carries the host's time as it is sent, but a guest
that has just woken reads it late: under TCG a restored guest takes ~100 ms to get to it
(measured: guests from a template ran 107-134 ms behind the host; 8-15 ms after a live
resume), and sets its clock that much behind. Its answer carries its clock as it answers
(``wall_ns``); the host compares that with its own clock on arrival and posts the
difference as a *relative* correction (``clock {adjust_ns}``), which the guest applies to
its own clock, so the delay of that second message does not matter. What remains is the
answer's trip to the host (about a millisecond), by which the guest runs ahead.

The correction is posted, not awaited: it is on the channel before anything sent later (the
first exec), and the harness handles it in order, so no command sees the late clock.
"""

from __future__ import annotations

import logging
from typing import Any

from pal.guest import protocol as p
from pal.manager.channel import HarnessChannel

log = logging.getLogger(__name__)

SLACK_NS = 1_000_000  # a lag this small is within the answer's own trip: left alone


def lag_ns(result: dict[str, Any], received_ns: int) -> int | None:
    """How far behind the host the guest's clock was when its answer (``result``) arrived
    at ``received_ns``; None when there is nothing worth correcting (an older harness sent
    no clock, the guest is not behind, or the lag is no read delay)."""
    wall = result.get("wall_ns")
    if not isinstance(wall, int) or isinstance(wall, bool):
        return None
    lag = received_ns - wall
    if lag <= SLACK_NS or lag > p.MAX_CLOCK_ADJUST_NS:
        return None
    return lag


async def correct(channel: HarnessChannel, result: dict[str, Any], received_ns: int) -> int:
    """Post the correction the answer ``result`` calls for; returns the lag corrected (ns,
    0 for none). A channel that broke is left to the caller's next request to notice."""
    lag = lag_ns(result, received_ns)
    if lag is None:
        return 0
    try:
        await channel.post({"k": p.K_CLOCK, "adjust_ns": lag})
    except Exception as exc:
        log.warning("VM %s: clock correction not sent: %s", channel.vm_id, exc)
        return 0
    return lag
