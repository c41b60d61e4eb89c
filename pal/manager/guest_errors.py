"""Map the harness's error codes to Pal's error types (and so to HTTP statuses)."""

from __future__ import annotations

from pal.errors import (
    BackendError,
    GuestTimeout,
    InvalidRequest,
    NotFound,
    PalError,
    PathEscape,
    TooLarge,
)
from pal.guest import protocol as p
from pal.manager.channel import GuestError


def to_pal_error(exc: GuestError) -> PalError:
    code, msg = exc.guest_code, exc.message
    if code == p.ERR_ESCAPE:
        return PathEscape(msg)
    if code == p.ERR_NOENT:
        return NotFound(msg, code="FILE_NOT_FOUND")
    if code == p.ERR_TOOBIG:
        return TooLarge(msg)
    if code in (p.ERR_ISDIR, p.ERR_NOTDIR, p.ERR_INVAL, p.ERR_PERM):
        return InvalidRequest(msg, code=code)
    if code == p.ERR_TIMEOUT:
        return GuestTimeout(msg)
    return BackendError(msg, code=code)
