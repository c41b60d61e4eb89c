"""A QEMU process's runstate: the states, THE table of which may follow which, and the
guard that makes each operation valid only in named runstates (qemu.py is its one user).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar


class Runstate(enum.Enum):
    IDLE = "idle"  # constructed; no process yet
    STARTING = "starting"  # QEMU exec'd, QMP not answering yet
    INCOMING = "incoming"  # waiting in -incoming defer for load()
    LOADING = "loading"  # the incoming migration is running
    RUNNING = "running"  # guest CPUs run
    PAUSED = "paused"  # guest CPUs stopped (a live pause, after a capture, or before cont on load)
    CAPTURING = "capturing"  # outgoing migration and file capture of a stopped guest
    EXITED = "exited"  # the process is gone (terminal)


S = Runstate
# THE table: which runstate may follow which. EXITED may follow any (QEMU can die anytime).
NEXT: dict[Runstate, frozenset[Runstate]] = {
    S.IDLE: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.RUNNING, S.INCOMING, S.PAUSED}),  # PAUSED: an adopted live pause
    S.INCOMING: frozenset({S.LOADING}),
    S.LOADING: frozenset({S.PAUSED}),
    S.RUNNING: frozenset({S.PAUSED}),
    S.PAUSED: frozenset({S.RUNNING, S.CAPTURING}),
    S.CAPTURING: frozenset({S.PAUSED}),
    S.EXITED: frozenset(),
}

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Guarded(Protocol):
    def _check(self, op: str, states: tuple[Runstate, ...]) -> None: ...


G = TypeVar("G", bound=Guarded)


def require(
    *states: Runstate,
) -> Callable[[Callable[Concatenate[G, _P], Awaitable[_R]]], Callable[Concatenate[G, _P], Awaitable[_R]]]:
    """Decorator: the call is valid only in ``states`` (checked before any work)."""

    def deco(
        fn: Callable[Concatenate[G, _P], Awaitable[_R]],
    ) -> Callable[Concatenate[G, _P], Awaitable[_R]]:
        @functools.wraps(fn)
        async def wrapper(self: G, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            self._check(fn.__name__, states)
            return await fn(self, *args, **kwargs)

        return wrapper

    return deco
