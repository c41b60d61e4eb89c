"""The agent API's credentials (docs/e2b.md, "Who may call the agent API").

- A ``secure`` sandbox's envd access token, minted when it is created and given only in
  the create/connect answer: every agent call carries it in ``X-Access-Token``.
- A file URL's signature instead of the token (``download_url()``/``upload_url()``):
  ``v1_`` + base64 (standard alphabet, unpadded) of
  sha256(``{path}:{read|write}:{username}:{token}[:{expiration}]``).
- The user a call acts as: ``Authorization: Basic base64("{user}:")`` on RPC calls,
  ``username=`` on ``/files``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from typing import Literal

from pal.errors import InvalidRequest, Unauthorized

Operation = Literal["read", "write"]

# A POSIX user name, as useradd takes it (and nothing a shell or path could misread).
_USER = re.compile(r"\A[a-z_][a-z0-9_-]{0,31}\Z")


def new_access_token() -> str:
    """A secure sandbox's envd access token (256 bits)."""
    return secrets.token_hex(32)


def token_matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def signature(path: str, operation: Operation, user: str | None, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{user or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def check_signature(
    given: str,
    expiration: str | None,
    *,
    path: str,
    operation: Operation,
    user: str | None,
    token: str,
    now: Callable[[], float] = time.time,
) -> None:
    """Unauthorized unless ``given`` signs this operation on this path as this user, and
    its expiration (when it has one) is still ahead."""
    exp: int | None = None
    if expiration not in (None, ""):
        try:
            exp = int(str(expiration))
        except ValueError:
            raise InvalidRequest("signature_expiration must be unix seconds") from None
    want = signature(path, operation, user, token, exp)
    if not hmac.compare_digest(given.encode(), want.encode()):
        raise Unauthorized("invalid file URL signature")
    if exp is not None and exp < now():
        raise Unauthorized("file URL signature expired")


def check_user(user: str | None) -> str | None:
    """``user`` when it is a valid user name (None: the default user); 400 otherwise."""
    if user is None or user == "":
        return None
    if not _USER.match(user):
        raise InvalidRequest(f"invalid user name {user!r}")
    return user


def basic_user(authorization: str | None) -> str | None:
    """The user named by ``Authorization: Basic base64("user:")`` (None: no header)."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        raise InvalidRequest("the user goes in 'Authorization: Basic base64(user:)'")
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidRequest("Authorization: Basic is not base64 of 'user:'") from None
    user, _, _password = decoded.partition(":")
    return check_user(user)
