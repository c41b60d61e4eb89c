"""Signed port links, and how they end (docs/ports.md).

A link opens one VM port without the API key: ``?palToken=<token>``, the token signed with
the server's secret (itsdangerous, HMAC) over the tenant, VM, port, expiry, the link's own
id and a fingerprint of the API key that asked for it. It opens that port while all hold:

- it has not expired, and it names this VM and port;
- its id is not on the tenant's revocation list (``DELETE .../port-links/{linkId}``);
- the API key it was made with still authenticates the tenant: ``pal tenants rotate-key``
  ends every link made with the old key, at once or after ``--grace-secs`` like the key.

The last two are read from the store (one read per request a link authorises), so a
revocation on any replica holds on all of them at once.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi.concurrency import run_in_threadpool
from itsdangerous import BadSignature, URLSafeSerializer

from pal.errors import Unauthorized

MAX_LINK_SECS = 7 * 24 * 3600
# Link cookies of one request looked at: a page of a sibling origin may add some (each costs
# an HMAC check; only one for this port reaches the store), but not make a request do
# unbounded work. Tossing that many only denies the port to that browser, never opens it.
MAX_LINK_COOKIES = 32
_ID = "pl-"


@dataclass(frozen=True)
class Link:
    tenant_id: str
    vm_id: str
    port: int
    expires_at: int
    link_id: str
    key_fingerprint: str


def key_fingerprint(key_hash: str) -> str:
    """Names the API key (by its stored hash) in a link without revealing the hash."""
    return hashlib.sha256(b"pal-port-link-key:" + key_hash.encode()).hexdigest()[:24]


def new_link_id() -> str:
    return _ID + secrets.token_hex(12)


def is_link_id(value: str) -> bool:
    rest = value[len(_ID) :]
    return value.startswith(_ID) and len(rest) == 24 and all(c in "0123456789abcdef" for c in rest)


class Links:
    """Makes and checks port links; ``store`` answers the revocation and key checks."""

    def __init__(
        self, secret: bytes, store: Any, *, salt: str = "pal-port-link-v2", noun: str = "port"
    ) -> None:
        """``salt`` keeps one kind of link from opening another (a process attach link,
        pal/api/process_attach.py, names a process id where a port link names a port);
        ``noun``: what the number names, in the errors."""
        self._signer = URLSafeSerializer(secret, salt=salt)
        self._store = store
        self._noun = noun

    def sign(self, tenant_id: str, vm_id: str, port: int, expires_at: int, key_hash: str) -> Link:
        return Link(tenant_id, vm_id, port, expires_at, new_link_id(), key_fingerprint(key_hash))

    def token(self, link: Link) -> str:
        data = {
            "t": link.tenant_id,
            "v": link.vm_id,
            "p": link.port,
            "e": link.expires_at,
            "i": link.link_id,
            "k": link.key_fingerprint,
        }
        return str(self._signer.dumps(data))

    def decode(self, token: str) -> Link:
        """The link a token carries, its signature checked (nothing else); Unauthorized."""
        try:
            d = self._signer.loads(token)
            return Link(str(d["t"]), str(d["v"]), int(d["p"]), int(d["e"]), str(d["i"]), str(d["k"]))
        except (BadSignature, KeyError, TypeError, ValueError):
            raise Unauthorized(f"invalid {self._noun} link") from None

    def check_bounds(self, token: str, vm_id: str, port: int, now: float) -> Link:
        """The link, if it is for this VM and port and unexpired (no store read)."""
        link = self.decode(token)
        if link.vm_id != vm_id or link.port != port:
            raise Unauthorized(f"this link is for another VM or {self._noun}")
        if link.expires_at <= now:
            raise Unauthorized(f"this {self._noun} link has expired")
        return link

    async def tenant(self, token: str, vm_id: str, port: int, now: float | None = None) -> str:
        """The tenant a valid link for this VM and port was made by; Unauthorized when it is
        foreign, expired, revoked, or its key was rotated out."""
        link = self.check_bounds(token, vm_id, port, time.time() if now is None else now)
        state = await run_in_threadpool(self._store.port_link_check, link.tenant_id, link.link_id)
        if state is None:
            raise Unauthorized(f"invalid {self._noun} link")
        if state.revoked:
            raise Unauthorized(f"this {self._noun} link was revoked")
        if link.key_fingerprint not in {key_fingerprint(h) for h in state.key_hashes}:
            ended = f"this {self._noun} link ended with the API key it was made with (key rotated)"
            raise Unauthorized(ended)
        return link.tenant_id

    async def first_valid(self, tokens: list[str], vm_id: str, port: int) -> str:
        """The tenant of the first of several cookies' tokens that opens this port (a page
        of another origin may have added cookies of the same name: they never displace a
        valid one); the last refusal when none does."""
        refused = Unauthorized("no port link")
        for token in tokens[:MAX_LINK_COOKIES]:
            try:
                return await self.tenant(token, vm_id, port)
            except Unauthorized as exc:
                refused = exc
        raise refused

    async def revoke(self, tenant_id: str, link_id: str) -> None:
        """Revoke one of the tenant's links (idempotent); it is refused from now on."""
        from datetime import UTC, datetime, timedelta

        until = datetime.now(UTC) + timedelta(seconds=MAX_LINK_SECS)
        await run_in_threadpool(self._store.revoke_port_link, tenant_id, link_id, until)
