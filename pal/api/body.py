"""Bounded request bodies: file uploads are refused past 1 MiB without buffering more."""

from __future__ import annotations

from fastapi import Request

from pal.errors import InvalidRequest, TooLarge

MAX_FILE_BYTES = 1024 * 1024  # the files API limit (spec: "at most 1 MiB")


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
            raise TooLarge(f"file content is {length} bytes; the limit is {limit} bytes (1 MiB)")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise TooLarge(f"file content exceeds the limit of {limit} bytes (1 MiB)")
        chunks.append(chunk)
    return b"".join(chunks)
