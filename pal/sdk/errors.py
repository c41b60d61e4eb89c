"""Errors the SDK raises: one class per API status, all carrying (status, code, message)."""

from __future__ import annotations


class PalApiError(Exception):
    """The server answered `{"error": {"code", "message", "requestId"}}` (or could not be
    reached: status 0). ``request_id`` finds the request in the server's log."""

    def __init__(self, status: int, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" (request {request_id})" if request_id else ""))
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id


class PalConnectionError(PalApiError):
    """No HTTP answer at all (server down, wrong PAL_URL, network error)."""


class BadRequestError(PalApiError):
    pass


class AuthenticationError(PalApiError):
    pass


class QuotaExceededError(PalApiError):
    pass


class PermissionDeniedError(PalApiError):
    pass


class NotFoundError(PalApiError):
    pass


class ConflictError(PalApiError):
    pass


class PayloadTooLargeError(PalApiError):
    pass


class ServerError(PalApiError):
    pass


_BY_STATUS: dict[int, type[PalApiError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: QuotaExceededError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
}


def error_for(status: int, code: str, message: str, request_id: str | None = None) -> PalApiError:
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else PalApiError)
    return cls(status, code, message, request_id)
