"""One error type for the whole product, wrapping each subsystem's failures.

Every layer raises a :class:`PalError` subclass; the API maps ``status``/``code`` to
``{"error": {"code", "message"}}`` without knowing where the error came from, and the
manager RPC carries the same code/status across the process boundary.
"""

from __future__ import annotations

import re


class PalError(Exception):
    status: int = 500
    code: str = "INTERNAL"
    # What the status means to a client: its description in /openapi.json's error responses.
    summary: str = "internal error"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


# An absolute host path (not a URL's path: no '/', word char, '.' or ':' right before it).
_HOST_PATH = re.compile(r"(?<![\w/.:])/[^\s'\",;()\[\]{}<>]+")
PUBLIC_MESSAGE_MAX = 300


def public_message(message: str, limit: int = PUBLIC_MESSAGE_MAX) -> str:
    """A backend failure's message as a client may see it (API errors, a VM's reason): its
    first line only (QEMU log tails and tracebacks come after it), host paths replaced by
    ``<path>``, at most ``limit`` characters. The full text goes to the server log."""
    first = message.split("\n", 1)[0].strip()
    first = _HOST_PATH.sub("<path>", first)
    return first if len(first) <= limit else first[: limit - 1] + "…"


class InvalidRequest(PalError):
    status, code = 400, "INVALID_ARGUMENT"
    summary = "invalid request"


class PathEscape(InvalidRequest):
    code = "PATH_ESCAPE"


class Unauthorized(PalError):
    status, code = 401, "UNAUTHENTICATED"
    summary = "missing or invalid API key"


class QuotaExceeded(PalError):
    status, code = 402, "QUOTA_EXCEEDED"
    summary = "tenant quota exhausted"


class Forbidden(PalError):
    status, code = 403, "PERMISSION_DENIED"
    summary = "this key or client may not do this"


class NotFound(PalError):
    status, code = 404, "NOT_FOUND"
    summary = "unknown VM (or another tenant's)"


class VolumeNotFound(NotFound):
    """A volume named in a request is not the tenant's (the same 404 as any unknown name;
    the type lets a surface that answers it otherwise, E2B's 400, tell it apart)."""

    summary = "unknown volume (or another tenant's)"


class Conflict(PalError):
    """Wrong lifecycle state for the call (an illegal transition, exec on a paused VM...)."""

    status, code = 409, "FAILED_PRECONDITION"
    summary = "wrong lifecycle state"


class LivePaused(Conflict):
    """Exec, files or ports on a VM whose vCPUs a live pause stopped: the scheduler wakes
    it and asks again (the one definition of LIVE_PAUSED)."""

    code = "LIVE_PAUSED"


class TooLarge(PalError):
    status, code = 413, "PAYLOAD_TOO_LARGE"
    summary = "body too large"


class UnsupportedMediaType(PalError):
    status, code = 415, "UNSUPPORTED_MEDIA_TYPE"
    summary = "body not sent as `Content-Type: application/json`"


class TooManyRequests(PalError):
    """The tenant holds too much of a shared budget right now (buffered exec output,
    long-lived calls), or asks too often (``retry_after_s``: when to ask again)."""

    status, code = 429, "RESOURCE_EXHAUSTED"
    summary = "the tenant holds its whole budget of this right now"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message, code=code, status=status)
        self.retry_after_s = retry_after_s


class BackendError(PalError):
    """The VMM, guest or storage failed doing something that should have worked."""

    status, code = 500, "BACKEND_ERROR"
    summary = "the backend failed doing something that should have worked"


class BadGateway(PalError):
    """A server in the guest that Pal proxies to (ports) is not there or broke the exchange."""

    status, code = 502, "BAD_GATEWAY"
    summary = "the sandbox's own server is not there or broke"


class Unavailable(PalError):
    """The backend cannot do this at all (no image, no accelerator, manager down)."""

    status, code = 503, "UNAVAILABLE"
    summary = "backend cannot do it"


class NotLeader(Unavailable):
    """This control-plane replica does not hold the leadership lease (any more): its
    state-mutating transaction was refused (fencing). Followers forward such requests."""

    code = "NOT_LEADER"


class GuestTimeout(PalError):
    status, code = 504, "GUEST_TIMEOUT"
    summary = "the sandbox did not answer in time"


class InsufficientStorage(PalError):
    """The node lacks the disk or memory this would need (checked before any work)."""

    status, code = 507, "INSUFFICIENT_STORAGE"
    summary = "the node has no room for it (disk or memory)"


def _status_classes() -> dict[int, type[PalError]]:
    """Each status and the one class that states it (with its code): PalError's direct
    subclasses here. Their subclasses keep the status and may give a finer code."""
    found: dict[int, type[PalError]] = {}
    for cls in PalError.__subclasses__():
        if cls.__module__ == __name__:
            if cls.status in found:
                raise TypeError(f"{cls.__name__} and {found[cls.status].__name__} both state {cls.status}")
            found[cls.status] = cls
    return found


BY_STATUS: dict[int, type[PalError]] = _status_classes()


def from_wire(status: int, code: str, message: str) -> PalError:
    """Rebuild an error that crossed the manager RPC boundary."""
    cls = BY_STATUS.get(status, PalError)
    return cls(message, code=code, status=status)
