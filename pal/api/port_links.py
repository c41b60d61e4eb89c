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

A link also ends what it opened (``Links.while_valid``): every socket a link opened (a
WebSocket, a process attach, a port tunnel, a proxied response still streaming) is
registered by the link's id and closed when the link ends, at once when it is revoked here,
else at its expiry or at the next check of the store (``LINK_RECHECK_S``: a revocation on
another replica, a key rotated out).

A link is accepted only from its own origin (``origin_ok``): a request without ``Origin``
(not a browser), or one whose ``Origin`` is where the link points (the API's own host for an
attach link or the port path route; the port's own origin, or another port of the same VM,
on the ports listener). A page elsewhere that got hold of a link cannot open a socket with
it. An attach link may be read-only (``readOnly``): output only, no input, signals or
resizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from fastapi.concurrency import run_in_threadpool
from itsdangerous import BadSignature, URLSafeSerializer

from pal.errors import Unauthorized

MAX_LINK_SECS = 7 * 24 * 3600
# Link cookies of one request looked at: a page of a sibling origin may add some (each costs
# an HMAC check; only one for this port reaches the store), but not make a request do
# unbounded work. Tossing that many only denies the port to that browser, never opens it.
MAX_LINK_COOKIES = 32
LINK_RECHECK_S = 5.0  # an open socket's link is checked against the store this often
_ID = "pl-"
T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    tenant_id: str
    vm_id: str
    port: int
    expires_at: int
    link_id: str
    key_fingerprint: str
    read_only: bool = False  # an attach link that opens output only


@dataclass
class OpenLinks:
    """The sockets links opened, by link id: a revocation wakes their watchers at once.
    One per app, shared by every kind of link (the revocation route is one)."""

    waiting: dict[str, set[asyncio.Event]] = field(default_factory=dict)

    def ended(self, link_id: str) -> None:
        for ev in self.waiting.get(link_id, ()):
            ev.set()


def origin_ok(
    origin: bytes | str | None, host: bytes | str | None, also: Callable[[str], bool] | None = None
) -> bool:
    """Whether a link may be used by a request with this ``Origin``: none (no browser sent
    it), the origin of the ``Host`` it was sent to (the link's own), or one ``also`` allows."""
    if origin is None:
        return True
    o = origin.decode("latin-1") if isinstance(origin, bytes) else origin
    h = (host.decode("latin-1") if isinstance(host, bytes) else host or "").lower()
    if urlsplit(o).netloc.lower() == h and h:
        return True
    return also is not None and also(o)


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
        self,
        secret: bytes,
        store: Any,
        *,
        salt: str = "pal-port-link-v2",
        noun: str = "port",
        opened: OpenLinks | None = None,
    ) -> None:
        """``salt`` keeps one kind of link from opening another (a process attach link,
        pal/api/process_attach.py, names a process id where a port link names a port);
        ``noun``: what the number names, in the errors; ``opened``: the app's registry of
        the sockets links opened (shared by every kind of link)."""
        self._signer = URLSafeSerializer(secret, salt=salt)
        self._store = store
        self._noun = noun
        self.opened = opened if opened is not None else OpenLinks()

    def sign(
        self,
        tenant_id: str,
        vm_id: str,
        port: int,
        expires_at: int,
        key_hash: str,
        *,
        read_only: bool = False,
    ) -> Link:
        return Link(tenant_id, vm_id, port, expires_at, new_link_id(), key_fingerprint(key_hash), read_only)

    def token(self, link: Link) -> str:
        data: dict[str, Any] = {
            "t": link.tenant_id,
            "v": link.vm_id,
            "p": link.port,
            "e": link.expires_at,
            "i": link.link_id,
            "k": link.key_fingerprint,
        }
        if link.read_only:
            data["r"] = 1
        return str(self._signer.dumps(data))

    def decode(self, token: str) -> Link:
        """The link a token carries, its signature checked (nothing else); Unauthorized."""
        try:
            d = self._signer.loads(token)
            return Link(
                str(d["t"]), str(d["v"]), int(d["p"]), int(d["e"]), str(d["i"]), str(d["k"]), d.get("r") == 1
            )
        except (BadSignature, KeyError, TypeError, ValueError, AttributeError):
            raise Unauthorized(f"invalid {self._noun} link") from None

    def check_bounds(self, token: str, vm_id: str, port: int, now: float) -> Link:
        """The link, if it is for this VM and port and unexpired (no store read)."""
        link = self.decode(token)
        if link.vm_id != vm_id or link.port != port:
            raise Unauthorized(f"this link is for another VM or {self._noun}")
        if link.expires_at <= now:
            raise Unauthorized(f"this {self._noun} link has expired")
        return link

    async def check(self, token: str, vm_id: str, port: int, now: float | None = None) -> Link:
        """A valid link for this VM and port; Unauthorized when it is foreign, expired,
        revoked, or its key was rotated out."""
        link = self.check_bounds(token, vm_id, port, time.time() if now is None else now)
        await self._still_open(link)
        return link

    async def tenant(self, token: str, vm_id: str, port: int, now: float | None = None) -> str:
        """The tenant a valid link for this VM and port was made by (:meth:`check`)."""
        return (await self.check(token, vm_id, port, now)).tenant_id

    async def _still_open(self, link: Link) -> None:
        state = await run_in_threadpool(self._store.port_link_check, link.tenant_id, link.link_id)
        if state is None:
            raise Unauthorized(f"invalid {self._noun} link")
        if state.revoked:
            raise Unauthorized(f"this {self._noun} link was revoked")
        if link.key_fingerprint not in {key_fingerprint(h) for h in state.key_hashes}:
            ended = f"this {self._noun} link ended with the API key it was made with (key rotated)"
            raise Unauthorized(ended)

    async def first_valid(self, tokens: list[str], vm_id: str, port: int) -> Link:
        """The first of several cookies' links that opens this port (a page of another
        origin may have added cookies of the same name: they never displace a valid one);
        the last refusal when none does."""
        refused = Unauthorized("no port link")
        for token in tokens[:MAX_LINK_COOKIES]:
            try:
                return await self.check(token, vm_id, port)
            except Unauthorized as exc:
                refused = exc
        raise refused

    async def revoke(self, tenant_id: str, link_id: str) -> None:
        """Revoke one of the tenant's links (idempotent); it is refused from now on, and
        the sockets it opened on this server close at once (other replicas' at their next
        check)."""
        from datetime import UTC, datetime, timedelta

        until = datetime.now(UTC) + timedelta(seconds=MAX_LINK_SECS)
        await run_in_threadpool(self._store.revoke_port_link, tenant_id, link_id, until)
        self.opened.ended(link_id)

    async def until_ended(self, link: Link) -> str:
        """Wait until ``link`` opens nothing any more (expired, revoked, its key rotated
        out); why, in words."""
        woken = asyncio.Event()
        self.opened.waiting.setdefault(link.link_id, set()).add(woken)
        try:
            while True:
                left = link.expires_at - time.time()
                if left <= 0:
                    return f"this {self._noun} link has expired"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(left, LINK_RECHECK_S))
                woken.clear()
                try:
                    await self._still_open(link)
                except Unauthorized as exc:
                    return exc.message
        finally:
            watchers = self.opened.waiting.get(link.link_id, set())
            watchers.discard(woken)
            if not watchers:
                self.opened.waiting.pop(link.link_id, None)

    async def while_valid(
        self, link: Link | None, work: Coroutine[Any, Any, T], on_end: Callable[[str], Awaitable[None]]
    ) -> T | None:
        """Run ``work`` (a socket's session); when it was opened by ``link`` and the link
        ends first, cancel it and ``on_end(why)`` (close the socket, saying why)."""
        if link is None:
            return await work
        session = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(self.until_ended(link))
        try:
            done, _ = await asyncio.wait({session, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if session in done:
                return session.result()
            session.cancel()
            with contextlib.suppress(BaseException):
                await session
            await on_end(watcher.result())
            return None
        finally:
            for t in (session, watcher):
                t.cancel()
            await asyncio.gather(session, watcher, return_exceptions=True)

    async def cut_when_ended(self, link: Link | None, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """``chunks`` (a proxied response's body) until ``link``, which opened it, ends."""
        it = aiter(chunks)
        if link is None:
            async for chunk in it:
                yield chunk
            return
        stop = asyncio.ensure_future(self.until_ended(link))
        try:
            while True:
                nxt = asyncio.ensure_future(anext(it))
                await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    return  # the link ended: so does what it opened
                try:
                    yield nxt.result()
                except StopAsyncIteration:
                    return
        finally:
            stop.cancel()
            with contextlib.suppress(BaseException):
                await stop
