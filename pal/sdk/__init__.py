"""Pal SDK: talk to a Pal server over HTTP. Imports nothing from `pal` outside `pal.sdk`,
so it works when installed on its own (it needs only httpx)."""

from .async_client import AsyncClient
from .client import Client
from .code import CodeError, CodeOutput, CodeResult
from .errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    PalApiError,
    PalConnectionError,
    PayloadTooLargeError,
    PermissionDeniedError,
    QuotaExceededError,
    ServerError,
)
from .models import ExecEvent, ExecResult, FileBytes, FileText, OutputEvent
from .terminal import AsyncTerminal, Terminal

__all__ = [
    "AsyncClient",
    "AsyncTerminal",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "CodeError",
    "CodeOutput",
    "CodeResult",
    "ConflictError",
    "ExecEvent",
    "ExecResult",
    "FileBytes",
    "FileText",
    "NotFoundError",
    "OutputEvent",
    "PalApiError",
    "PalConnectionError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "ServerError",
    "Terminal",
]
