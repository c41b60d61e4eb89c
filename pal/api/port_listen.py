"""The ports proxy's short wait for a server that is still starting (pal/api/ports.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from pal.errors import PalError
from pal.wire.tunnel import TunnelStream

# A server just started in the guest (`setsid server &`, then a request) takes a moment to
# bind under TCG; answering 502 at once made every script race it. So the proxy retries
# "nothing listening" for this long; a port nobody serves still answers 502 after it.
LISTEN_WAIT_S = 5.0


async def listening_stream(
    stack: contextlib.AsyncExitStack, open_stream: Callable[[], AbstractAsyncContextManager[TunnelStream]]
) -> TunnelStream:
    """The port's stream, retried while nothing listens there yet (up to LISTEN_WAIT_S)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LISTEN_WAIT_S
    delay = 0.05
    while True:
        try:
            return await stack.enter_async_context(open_stream())
        except PalError as exc:
            if exc.code != "PORT_NOT_LISTENING" or loop.time() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)
