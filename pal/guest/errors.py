"""The harness's one error type: a protocol error code and a message for the host."""

from __future__ import annotations

import errno

from pal.guest import protocol as P


class ExecError(Exception):
    """A request failed with one of the protocol's error codes."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


ERRNO_CODES = {
    errno.ENOENT: P.ERR_NOENT,
    errno.EISDIR: P.ERR_ISDIR,
    errno.ENOTDIR: P.ERR_NOTDIR,
    errno.EACCES: P.ERR_PERM,
    errno.EPERM: P.ERR_PERM,
    errno.EEXIST: P.ERR_NOTDIR,  # makedirs over a file
}
