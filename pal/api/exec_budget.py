"""A tenant's budget of buffered exec output on this API server.

A buffered exec (no ``Accept: text/event-stream``) holds the command's output in the
server's memory until the command ends, up to ``BUFFERED_OUTPUT_MAX`` characters per
stream. Concurrent execs multiply that, so each tenant also has a budget for all of its
buffered execs together (``PAL_EXEC_BUFFER_MIB``, in MiB of characters):

- a new buffered exec while the tenant's execs already hold the whole budget is refused
  before anything runs: 429 ``RESOURCE_EXHAUSTED`` (stream it with SSE, or wait for the
  others to finish);
- an exec running when the budget runs out keeps running; what it prints beyond the
  budget is not kept and its answer says ``truncated: true`` (as for the per-stream cap).

The memory is given back when the answer has been sent (or the client went away). The
budget is per server process; each replica has its own.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Receive, Scope, Send

from pal.errors import TooManyRequests

from .json_response import JSONResponse

MIB = 1024 * 1024


class ExecBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}

    def lease(self, tenant: str) -> Lease:
        """A lease for one buffered exec of ``tenant``; 429 when its budget is all held."""
        held = self.held.get(tenant, 0)
        if held >= self.limit:
            raise TooManyRequests(
                f"this tenant's buffered execs already hold {held} characters of output, its budget "
                f"(PAL_EXEC_BUFFER_MIB={self.limit // MIB}): stream with `Accept: text/event-stream`, "
                "or retry when they have finished"
            )
        return Lease(self, tenant)


class Lease:
    """What one buffered exec holds of its tenant's budget; released once."""

    def __init__(self, budget: ExecBudget, tenant: str) -> None:
        self.budget, self.tenant = budget, tenant
        self.taken = 0
        self.released = False

    def take(self, n: int) -> int:
        """Up to ``n`` characters more, as the budget has room for; how many were granted."""
        if self.released:
            return 0
        held = self.budget.held.get(self.tenant, 0)
        granted = max(0, min(n, self.budget.limit - held))
        if granted:
            self.budget.held[self.tenant] = held + granted
            self.taken += granted
        return granted

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        left = self.budget.held.get(self.tenant, 0) - self.taken
        if left > 0:
            self.budget.held[self.tenant] = left
        else:
            self.budget.held.pop(self.tenant, None)


class LeasedJSON(JSONResponse):
    """A JSON answer that gives its lease back once sent, or when sending failed."""

    def __init__(self, content: Any, lease: Lease) -> None:
        super().__init__(content)
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.lease.release()
