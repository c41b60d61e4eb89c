"""Cursor pagination for the sync and async clients: a list call fetches a page
(``limit``, ``cursor``), yields its items and follows ``nextCursor`` until it is null, so a
caller iterates a list of any length without seeing pages."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from ._wire import given

Page = dict[str, Any]


def params(page_size: int | None, metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """The first page's query: ``limit`` and the ``metadata.k=v`` filters."""
    out: dict[str, Any] = {f"metadata.{k}": v for k, v in (metadata or {}).items()}
    if page_size is not None:
        out["limit"] = page_size
    return out


def iterate(fetch: Callable[[dict[str, Any]], Page], field: str, query: dict[str, Any]) -> Iterator[Any]:
    """Every item of ``field`` over all pages; ``fetch`` gets each page's query."""
    query = dict(query)
    while True:
        page = fetch(query)
        yield from page[field]
        cursor = page.get("nextCursor")
        if not cursor:
            return
        query["cursor"] = cursor


async def aiterate(
    fetch: Callable[[dict[str, Any]], Awaitable[Page]], field: str, query: dict[str, Any]
) -> AsyncIterator[Any]:
    query = dict(query)
    while True:
        page = await fetch(query)
        for item in page[field]:
            yield item
        cursor = page.get("nextCursor")
        if not cursor:
            return
        query["cursor"] = cursor


def lifetime_body(
    lifetime_secs: int | None, extend_secs: int | None, on_lifetime_end: str | None
) -> dict[str, Any]:
    """PUT .../lifetime: exactly one of ``lifetime_secs`` (from the schedule; 0: none) and
    ``extend_secs``; ``on_lifetime_end`` (``pause``/``delete``) optionally."""
    return given(lifetimeSecs=lifetime_secs, extendSecs=extend_secs, onLifetimeEnd=on_lifetime_end)
