"""Bodies: JSON requests must say they are JSON; file uploads are refused past the files
limit without buffering more; file downloads say whether they are text. And the two rules
for a client's raw text that Python would half-accept: a number is ASCII digits (``"²"``
passes ``str.isdigit()`` and fails ``int()``), and JSON nested deeper than the parser
recurses is bad input (400), never a RecursionError (500)."""

from __future__ import annotations

import codecs
import json
from typing import Any

from fastapi import Request

from pal.errors import InvalidRequest, TooLarge, UnsupportedMediaType
from pal.guest.protocol import (
    MAX_FILE_BYTES as MAX_FILE_BYTES,  # the one definition (the harness enforces it too)
)

MAX_FILE_WORDS = f"{MAX_FILE_BYTES >> 20} MiB"  # the limit as messages and docs say it


def decimal(raw: str) -> int | None:
    """``raw`` as a non-negative integer when it is ASCII digits only, else None."""
    if not raw or not raw.isascii() or not raw.isdigit():
        return None
    return int(raw)


def json_value(raw: str | bytes, what: str = "the body") -> Any:
    """A client's JSON text decoded, or 400 naming ``what``: malformed, not UTF-8, or
    nested deeper than the parser can recurse."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidRequest(f"{what} is not valid JSON (or is nested too deeply)") from None


def require_json(request: Request) -> None:
    """A route dependency: a JSON body must come as ``Content-Type: application/json``.

    ``curl -d`` sends ``application/x-www-form-urlencoded``; rather than guess, the answer
    is 415 saying what to send. Refusing other types also keeps browsers from posting
    cross-site forms (a "simple" request) to a JSON route. No body at all is fine.
    """
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return
    given = request.headers.get("content-type", "")
    media = given.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise UnsupportedMediaType(
        f"the request body must be JSON sent with 'Content-Type: application/json' "
        f"(curl: -H 'Content-Type: application/json'); got {given or 'no Content-Type'}"
    )


def content_type(data: bytes, truncated: bool) -> str:
    """Text as ``text/plain; charset=utf-8``; anything that is not UTF-8 (binaries, other
    encodings) as ``application/octet-stream``, so no client decodes it by mistake. A cut
    at the limit may split the last character: that alone does not make it binary."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
    except UnicodeDecodeError:
        return "application/octet-stream"
    return "text/plain; charset=utf-8"


async def read_bounded(request: Request, limit: int = MAX_FILE_BYTES) -> bytes:
    """The request body, or 413 as soon as it is known to exceed ``limit`` bytes.

    Content-Length is checked first (no byte read); the stream is counted as well, since a
    chunked upload has no length and a client may lie about it.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise InvalidRequest("Content-Length is not a number") from None
        if length > limit:
            raise TooLarge(f"file content is {length} bytes; the limit is {limit} bytes")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise TooLarge(f"file content exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
