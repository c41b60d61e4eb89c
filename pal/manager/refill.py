"""The background refill of the node's standing sets (the warm pool, pool.py; the
pre-started QEMUs, prestart.py): make what is missing, one at a time, and after a failure
try again later, doubling the wait per failure in a row, so a node that cannot make one
(no template yet, no memory, a loaded host) does not keep trying at full speed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

RETRY_S = 30.0  # after a failed make, try again then, doubling per failure in a row
RETRY_MAX_S = 600.0  # up to this (a failed template build is a cold boot)


def retry_after(failures: int) -> float:
    """The wait after ``failures`` failed makes in a row (at least one)."""
    return min(RETRY_S * 2 ** max(0, failures - 1), RETRY_MAX_S)


async def refill_forever(
    missing: Callable[[], list[str]],
    make_one: Callable[[str], Awaitable[bool]],
    wake: asyncio.Event,
    before_each: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Make one of each ``missing()`` entry (``make_one``: False when it could not be made
    now), then sleep until ``wake`` is set, or a retry is due."""
    failures = 0
    while True:
        wake.clear()
        failed = False
        for key in missing():
            if before_each is not None:
                await before_each()
            if not await make_one(key):
                failed = True
                break
        failures = failures + 1 if failed else 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), retry_after(failures) if failed or missing() else None)
