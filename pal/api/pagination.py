"""Cursor pagination of the API's lists (VMs, a VM's events and snapshots, images).

A page is ``?limit=N&cursor=C``; its answer carries ``nextCursor`` (absent on the last page),
next to the list in the same envelope as before (``{vms: [...], nextCursor}``), so a client
that never pages still reads the list where it was. Without ``limit`` a page holds
:data:`MAX_PAGE_LIMIT` items, the most one answer ever holds.

A cursor is opaque to clients: base64url of ``[list kind, sort key of the page's last
item]``. Each list is in a fixed order by a unique key (VMs: creation time then id; events:
their id; snapshots: creation time then id; images: name), and the next page starts after
that key: items added or removed meanwhile never make a page repeat or skip the others.
A cursor that is not one this list handed out is a 400.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import Query, Request

from pal.errors import InvalidRequest
from pal.spec import METADATA_KEY, check_metadata

MAX_PAGE_LIMIT = 1000  # the most items of one answer, and a page's size without `limit`
MAX_CURSOR_CHARS = 1024
METADATA_PREFIX = "metadata."
T = TypeVar("T")

Limit = Annotated[
    int | None,
    Query(ge=1, le=MAX_PAGE_LIMIT, description=f"items per page (default and most: {MAX_PAGE_LIMIT})"),
]
Cursor = Annotated[
    str | None,
    Query(
        max_length=MAX_CURSOR_CHARS, description="`nextCursor` of the previous page; absent: the first page"
    ),
]


def encode(kind: str, key: Any) -> str:
    raw = json.dumps([kind, key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(kind: str, cursor: str | None) -> Any:
    """The sort key a cursor of ``kind`` carries (None: no cursor, the first page)."""
    if cursor is None:
        return None
    try:
        got = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError):
        got = None
    if not (isinstance(got, list) and len(got) == 2 and got[0] == kind and got[1] is not None):
        raise InvalidRequest(f"cursor {cursor[:64]!r} is not a cursor of this {kind} list")
    return got[1]


def page_size(limit: int | None) -> int:
    return limit or MAX_PAGE_LIMIT


def dated_after(kind: str, cursor: str | None) -> tuple[datetime, str] | None:
    """The ``(created_at, id)`` a cursor of a list ordered by creation carries (VMs, volumes,
    kept snapshots)."""
    key = decode(kind, cursor)
    if key is None:
        return None
    try:
        at, item_id = key
        return datetime.fromisoformat(at), str(item_id)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"cursor {cursor!r} is not a cursor of this {kind} list") from exc


def event_after(cursor: str | None) -> int | None:
    key = decode("events", cursor)
    if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
        raise InvalidRequest(f"cursor {cursor!r} is not a cursor of this events list")
    return key


def next_cursor(kind: str, rows: list[T], size: int, key: Callable[[T], Any]) -> tuple[list[T], str | None]:
    """``rows`` as fetched (up to ``size + 1``): the page and the cursor after it, if more."""
    if len(rows) <= size:
        return rows, None
    page = rows[:size]
    return page, encode(kind, key(page[-1]))


def in_memory(
    kind: str, items: Sequence[T], key: Callable[[T], Any], limit: int | None, cursor: str | None
) -> tuple[list[T], str | None]:
    """A page of a list the server holds whole (snapshots, images): sorted by ``key``."""
    after = decode(kind, cursor)
    ordered = sorted(items, key=key)
    if after is not None:
        try:
            ordered = [x for x in ordered if key(x) > _as_key(after)]
        except TypeError as exc:
            raise InvalidRequest(f"cursor {cursor!r} is not a cursor of this {kind} list") from exc
    return next_cursor(kind, ordered, page_size(limit), key)


def _as_key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def metadata_filter(request: Request) -> dict[str, str]:
    """``?metadata.k=v`` pairs (all must match), checked like schedule's metadata."""
    pairs: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if not name.startswith(METADATA_PREFIX):
            continue
        key = name[len(METADATA_PREFIX) :]
        if not METADATA_KEY.match(key):
            raise InvalidRequest(f"metadata filter {name[:80]!r}: the key is not a valid metadata key")
        if key in pairs and pairs[key] != value:
            raise InvalidRequest(f"metadata filter {name!r} is given twice with different values")
        pairs[key] = value
    try:
        return check_metadata(pairs)
    except ValueError as exc:
        raise InvalidRequest(f"metadata filter: {exc}") from exc
