"""Who is calling, as far as a follower replica can tell before it holds a request's body.

A follower forwards what it cannot answer to the leader (forward.py). Before it holds more
than ``UNAUTHENTICATED_BODY_MAX`` of a body it checks that the caller carries a credential
this replica can verify itself; an anonymous caller gets 401 at once, with the rest of its
body unread. The leader still authenticates and authorizes the request as it always does:
this check only decides whether the follower spends memory on it.

Credentials known here: the operator token, a tenant API key (looked up in the store), a
node's token (its id in ``X-Pal-Node``: the token is derived from ``PAL_CLUSTER_SECRET``
and the node id), and whatever another part of the app registers with :meth:`Callers.add`
(the dashboard its session cookie).
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import Scope

from pal.config import Settings
from pal.wire.auth import node_token

from .auth import tenant_for_key

log = logging.getLogger(__name__)

NODE_HEADER = "X-Pal-Node"
UNAUTHENTICATED_BODY_MAX = 256 * 1024  # a sign-in form, a heartbeat: never megabytes

Check = Callable[[HTTPConnection], "bool | Awaitable[bool]"]


class Callers:
    def __init__(self, store: Any, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.checks: list[Check] = [self._bearer]

    def add(self, check: Check) -> None:
        """Another credential a request may carry: ``check(conn)`` is true when it verifies."""
        self.checks.append(check)

    async def known(self, scope: Scope) -> bool:
        conn = HTTPConnection(scope)
        for check in self.checks:
            try:
                got = check(conn)
                if inspect.isawaitable(got):
                    got = await got
            except Exception as exc:  # a failing check knows nobody
                log.warning("caller check failed: %s", exc)
                continue
            if got:
                return True
        return False

    async def _bearer(self, conn: HTTPConnection) -> bool:
        scheme, _, given = conn.headers.get("authorization", "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return False
        s = self.settings
        if s.admin_token and hmac.compare_digest(given.encode(), s.admin_token.encode()):
            return True
        node = conn.headers.get(NODE_HEADER)
        if node and s.cluster_secret:
            return hmac.compare_digest(given.encode(), node_token(s.cluster_secret, node).encode())
        return await tenant_for_key(self.store, given) is not None
