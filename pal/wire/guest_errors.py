"""The one mapping of the harness's error codes (pal.guest.protocol ERR_*) to Pal's errors,
and so to HTTP statuses. Exec, file and process requests share it; the few codes that
mean something else for an exec (a missing *executable*) or a process request (a missing
*process*) say so in ``_EXEC`` and ``_PROCESS``.

| guest code | file requests | exec | process requests |
|---|---|---|---|
| EESCAPE | 400 PATH_ESCAPE | 400 PATH_ESCAPE | 400 PATH_ESCAPE |
| ENOENT | 404 FILE_NOT_FOUND | 400 EXECUTABLE_NOT_FOUND | 404 PROCESS_NOT_FOUND |
| EPERM | 400 EPERM | 400 NOT_EXECUTABLE | 400 NOT_EXECUTABLE |
| EINVAL, ENOTDIR, EISDIR | 400 (the guest's code) | 400 INVALID_ARGUMENT (bad cwd) | 400 INVALID_ARGUMENT |
| ETOOBIG | 413 PAYLOAD_TOO_LARGE | 413 PAYLOAD_TOO_LARGE | 413 PAYLOAD_TOO_LARGE |
| ETIMEDOUT | 504 GUEST_TIMEOUT | 504 GUEST_TIMEOUT (see below) | 504 GUEST_TIMEOUT |
| ESTATE | 409 PROCESS_STATE | 409 PROCESS_STATE | 409 PROCESS_STATE (exited, no stdin, no terminal) |
| ELIMIT | 429 TOO_MANY_PROCESSES | 429 TOO_MANY_PROCESSES | 429 TOO_MANY_PROCESSES |
| EAUTH, EIO, anything else | 503 (the guest's code) | 503 (the guest's code) | 503 (the guest's code) |

Code contexts (op ``code``) answer as exec, except: ENOENT 404 CONTEXT_NOT_FOUND, ELIMIT 429
TOO_MANY_CONTEXTS, ESTATE 409 CONTEXT_BUSY (a cell is running in it), ENOKERNEL 409
KERNEL_UNAVAILABLE (the image has no Jupyter: use the code-interpreter image).

ELIMIT is 429, not 409: the VM is in the right state, it has too many processes running
now, and the same request succeeds once some of them end (or are deleted).

An exec's ETIMEDOUT (its ``timeoutSecs`` ran out) never reaches this map through the API:
api/exec_stream.py turns it into exit status 124 with ``timedOut``, before asking here.

Unknown codes are 503, not 500: the guest (the backend) could not do it, and nothing it
sends is trusted to be a bug of ours.
"""

from __future__ import annotations

from typing import Literal

from pal.errors import (
    Conflict,
    GuestTimeout,
    InvalidRequest,
    NotFound,
    PalError,
    PathEscape,
    TooLarge,
    TooManyRequests,
    Unavailable,
)
from pal.guest import protocol as p

Op = Literal["file", "exec", "process", "code"]

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
    p.ERR_STATE: (Conflict, "PROCESS_STATE"),
    p.ERR_LIMIT: (TooManyRequests, "TOO_MANY_PROCESSES"),
}
_EXEC: dict[str, tuple[type[PalError], str | None]] = {
    **_FILE,
    p.ERR_NOENT: (InvalidRequest, "EXECUTABLE_NOT_FOUND"),
    p.ERR_PERM: (InvalidRequest, "NOT_EXECUTABLE"),
    p.ERR_INVAL: (InvalidRequest, "INVALID_ARGUMENT"),
    p.ERR_NOTDIR: (InvalidRequest, "INVALID_ARGUMENT"),
    p.ERR_ISDIR: (InvalidRequest, "INVALID_ARGUMENT"),
}
_PROCESS: dict[str, tuple[type[PalError], str | None]] = {
    **_EXEC,
    p.ERR_NOENT: (NotFound, "PROCESS_NOT_FOUND"),
}
# Code contexts (docs/agents.md): a missing *context* is 404, too many 429, an image
# without Jupyter 409 (the message names the code-interpreter image).
_CODE: dict[str, tuple[type[PalError], str | None]] = {
    **_EXEC,
    p.ERR_NOENT: (NotFound, "CONTEXT_NOT_FOUND"),
    p.ERR_LIMIT: (TooManyRequests, "TOO_MANY_CONTEXTS"),
    p.ERR_STATE: (Conflict, "CONTEXT_BUSY"),
    p.ERR_NOKERNEL: (Conflict, "KERNEL_UNAVAILABLE"),
}
_OPS = {"file": _FILE, "exec": _EXEC, "process": _PROCESS, "code": _CODE}


def to_pal_error(code: str | None, message: str | None, op: Op) -> PalError:
    """The error for a guest ``err`` reply with ``code`` to a file request, an exec or a
    process request."""
    guest_code = code or "GUEST_ERROR"
    cls, api_code = _OPS[op].get(guest_code, (Unavailable, None))
    return cls(message or f"guest error {guest_code}", code=api_code or guest_code)
