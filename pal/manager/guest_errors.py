"""The one mapping of the harness's error codes (pal.guest.protocol ERR_*) to Pal's errors,
and so to HTTP statuses. Exec and file requests share it; the few codes that mean
something else for an exec (a missing *executable*) say so in ``_EXEC``.

| guest code | file requests | exec |
|---|---|---|
| EESCAPE | 400 PATH_ESCAPE | 400 PATH_ESCAPE |
| ENOENT | 404 FILE_NOT_FOUND | 400 EXECUTABLE_NOT_FOUND |
| EPERM | 400 EPERM | 400 NOT_EXECUTABLE |
| EINVAL, ENOTDIR, EISDIR | 400 (the guest's code) | 400 INVALID_ARGUMENT (bad cwd, argv...) |
| ETOOBIG | 413 PAYLOAD_TOO_LARGE | 413 PAYLOAD_TOO_LARGE |
| ETIMEDOUT | 504 GUEST_TIMEOUT | 504 GUEST_TIMEOUT (see below) |
| EAUTH, EIO, anything else | 503 (the guest's code) | 503 (the guest's code) |

An exec's ETIMEDOUT (its ``timeoutSecs`` ran out) never reaches this map through the API:
api/exec_stream.py turns it into exit status 124 with ``timedOut``, before asking here.

Unknown codes are 503, not 500: the guest (the backend) could not do it, and nothing it
sends is trusted to be a bug of ours.
"""

from __future__ import annotations

from typing import Literal

from pal.errors import GuestTimeout, InvalidRequest, NotFound, PalError, PathEscape, TooLarge, Unavailable
from pal.guest import protocol as p

Op = Literal["file", "exec"]

# guest code -> (error class, API code; None keeps the guest's code)
_FILE: dict[str, tuple[type[PalError], str | None]] = {
    p.ERR_ESCAPE: (PathEscape, "PATH_ESCAPE"),
    p.ERR_NOENT: (NotFound, "FILE_NOT_FOUND"),
    p.ERR_PERM: (InvalidRequest, None),
    p.ERR_INVAL: (InvalidRequest, None),
    p.ERR_NOTDIR: (InvalidRequest, None),
    p.ERR_ISDIR: (InvalidRequest, None),
    p.ERR_TOOBIG: (TooLarge, "PAYLOAD_TOO_LARGE"),
    p.ERR_TIMEOUT: (GuestTimeout, "GUEST_TIMEOUT"),
}
_EXEC: dict[str, tuple[type[PalError], str | None]] = {
    **_FILE,
    p.ERR_NOENT: (InvalidRequest, "EXECUTABLE_NOT_FOUND"),
    p.ERR_PERM: (InvalidRequest, "NOT_EXECUTABLE"),
    p.ERR_INVAL: (InvalidRequest, "INVALID_ARGUMENT"),
    p.ERR_NOTDIR: (InvalidRequest, "INVALID_ARGUMENT"),
    p.ERR_ISDIR: (InvalidRequest, "INVALID_ARGUMENT"),
}


def to_pal_error(code: str | None, message: str | None, op: Op) -> PalError:
    """The error for a guest ``err`` reply with ``code`` to a file request or an exec."""
    guest_code = code or "GUEST_ERROR"
    cls, api_code = (_EXEC if op == "exec" else _FILE).get(guest_code, (Unavailable, None))
    return cls(message or f"guest error {guest_code}", code=api_code or guest_code)
