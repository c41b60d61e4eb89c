"""One error type for the whole product, wrapping each subsystem's failures.

Every layer raises a :class:`PalError` subclass; the API maps ``status``/``code`` to
``{"error": {"code", "message"}}`` without knowing where the error came from, and the
manager RPC carries the same code/status across the process boundary.
"""

from __future__ import annotations


class PalError(Exception):
    status: int = 500
    code: str = "INTERNAL"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


class InvalidRequest(PalError):
    status, code = 400, "INVALID_ARGUMENT"


class PathEscape(InvalidRequest):
    code = "PATH_ESCAPE"


class Unauthorized(PalError):
    status, code = 401, "UNAUTHENTICATED"


class QuotaExceeded(PalError):
    status, code = 402, "QUOTA_EXCEEDED"


class Forbidden(PalError):
    status, code = 403, "PERMISSION_DENIED"


class NotFound(PalError):
    status, code = 404, "NOT_FOUND"


class Conflict(PalError):
    """Wrong lifecycle state for the call (an illegal transition, exec on a paused VM...)."""

    status, code = 409, "FAILED_PRECONDITION"


class TooLarge(PalError):
    status, code = 413, "PAYLOAD_TOO_LARGE"


class BackendError(PalError):
    """The VMM, guest or storage failed doing something that should have worked."""

    status, code = 500, "BACKEND_ERROR"


class Unavailable(PalError):
    """The backend cannot do this at all (no image, no accelerator, manager down)."""

    status, code = 503, "UNAVAILABLE"


class GuestTimeout(PalError):
    status, code = 504, "GUEST_TIMEOUT"


_BY_STATUS: dict[int, type[PalError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    402: QuotaExceeded,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    500: BackendError,
    503: Unavailable,
    504: GuestTimeout,
}


def from_wire(status: int, code: str, message: str) -> PalError:
    """Rebuild an error that crossed the manager RPC boundary."""
    cls = _BY_STATUS.get(status, PalError)
    return cls(message, code=code, status=status)
