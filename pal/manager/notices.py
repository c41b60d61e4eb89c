"""What the node tells the scheduler without being asked: a bounded, numbered board the
scheduler long-polls (``GET /notices?after=&epoch=&waitS=``), like the gateway's events.

The node decides nothing about lifecycle states: it posts what it saw (a VM that may be
wait-paused, a live-paused VM whose data or timer is due, an offload done) and the
scheduler, the one owner of the transition table, acts. A notice lost with a restart is
not lost for good: the node re-posts what is still due when it starts (waits.py), and the
scheduler's reconciliation looks at every live-paused VM each tick.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any

from pal.wire.models import Notice, Notices

KEEP = 2000  # newest notices kept (a scheduler that fell further behind reconciles)
MAX_WAIT_S = 30.0


class NoticeBoard:
    def __init__(self, keep: int = KEEP) -> None:
        self.ring: deque[Notice] = deque(maxlen=keep)
        self.seq = 0
        self.epoch = f"{os.getpid()}-{time.time_ns()}"  # a restarted node numbers anew
        self._posted = asyncio.Event()
        self.closed = False

    def close(self) -> None:
        """The node shuts down: every long poll answers now (the server's graceful
        shutdown waits for requests in flight, which would be a whole poll)."""
        self.closed = True
        self._posted.set()

    def post(self, vm_id: str, kind: str, **fields: Any) -> Notice:
        self.seq += 1
        n = Notice(seq=self.seq, at=time.time(), vm_id=vm_id, kind=kind, **fields)  # type: ignore[arg-type]
        self.ring.append(n)
        self._posted.set()
        return n

    def since(self, after: int, epoch: str) -> Notices:
        start = after if epoch == self.epoch else 0
        return Notices(notices=[n for n in self.ring if n.seq > start], seq=self.seq, epoch=self.epoch)

    async def wait(self, after: int, epoch: str, wait_s: float) -> Notices:
        """Notices newer than ``after`` (all kept ones if ``epoch`` is not ours); waits up
        to ``wait_s`` for one when there is none yet."""
        deadline = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        while True:
            got = self.since(after, epoch)
            left = deadline - time.monotonic()
            if got.notices or left <= 0 or self.closed:
                return got
            self._posted.clear()
            try:
                await asyncio.wait_for(self._posted.wait(), left)
            except TimeoutError:
                pass
