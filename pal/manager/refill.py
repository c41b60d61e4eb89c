"""The background refill of the node's standing sets (the warm pool, pool.py; the
pre-started QEMUs, prestart.py): make what is missing, one at a time, and after a failure
try again later, doubling the wait per failure in a row, so a node that cannot make one
(no template yet, no memory, a loaded host) does not keep trying at full speed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pal.vmm.usage import process_memory

RETRY_S = 30.0  # after a failed make, try again then, doubling per failure in a row
RETRY_MAX_S = 600.0  # up to this (a failed template build is a cold boot)

T = TypeVar("T", bound="Standing")


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


class Standing(Protocol):
    """One thing a standing set keeps ready: its size entry, when it was made, its QEMU."""

    size: str
    made_at: float

    @property
    def pid(self) -> int | None: ...


class StandingSet(Generic[T]):
    """What the warm pool and the pre-started QEMUs share: per size entry a target, what is
    ready (by id), how many are being made, takes and misses so far, the last failure, and
    the refill task. ``MAKING`` and ``TAKEN`` are the names :meth:`status` gives the counts
    of makes under way and of takes (the node's stats read them)."""

    MAKING: ClassVar[str]
    TAKEN: ClassVar[str]

    def __init__(self, targets: dict[str, int]) -> None:
        self.targets = targets
        self.ready: dict[str, T] = {}  # id -> a thing ready to take
        self.making: dict[str, int] = {}  # size entry -> makes under way
        self.taken = 0
        self.misses = 0
        self.last_error: str | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def missing(self) -> list[str]:
        """Entries short of their target, one per thing to make."""
        out: list[str] = []
        for size, want in self.targets.items():
            have = sum(1 for x in self.ready.values() if x.size == size) + self.making.get(size, 0)
            out += [size] * max(0, want - have)
        return out

    def _refill_in_background(
        self,
        name: str,
        make_one: Callable[[str], Awaitable[bool]],
        before_each: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Keep the set at its targets: ``make_one(size)`` makes one (False: not now), counted
        in ``making`` while it runs."""

        async def make_counted(size: str) -> bool:
            self.making[size] = self.making.get(size, 0) + 1
            try:
                return await make_one(size)
            finally:
                self.making[size] -= 1

        self._task = asyncio.create_task(
            refill_forever(self.missing, make_counted, self._wake, before_each), name=name
        )

    async def _stop(self) -> list[T]:
        """Stop the refill; everything that was ready, now out of the set (for the caller
        to discard)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        ready, self.ready = list(self.ready.values()), {}
        return ready

    def status(self) -> dict[str, Any]:
        """Per size: target, ready, being made, the ready ones' QEMU RSS (which includes the
        guest RAM still resident); takes and misses so far; the last failure."""

        def row(target: int, making: int) -> dict[str, Any]:
            return {"target": target, "ready": 0, self.MAKING: making, "rssBytes": 0}

        per = {size: row(n, self.making.get(size, 0)) for size, n in self.targets.items()}
        for x in self.ready.values():
            r = per.setdefault(x.size, row(0, 0))
            r["ready"] += 1
            mem = process_memory(x.pid) if x.pid else None
            r["rssBytes"] += mem.rss_bytes if mem else 0
        return {
            "sizes": per,
            self.TAKEN: self.taken,
            "misses": self.misses,
            "rssBytes": sum(r["rssBytes"] for r in per.values()),
            "lastError": self.last_error,
        }
