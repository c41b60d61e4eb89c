"""E2B's conventions in a sandbox made through the E2B surface (docs/e2b.md, "The base
template"): what Pal's own API does not do, and what every E2B program takes for granted.

- The default user is ``user`` (uid 1000: the image's workload user, renamed when the
  sandbox is made), its home and working directory ``/home/user``; ``root`` on request.
  Pal runs commands as its workload user or root only, so any other name is refused.
- Commands get E2B's environment: ``E2B_SANDBOX=true``, ``E2B_SANDBOX_ID``, ``HOME``,
  ``USER``, ``LOGNAME`` of the user, then the create's ``envVars`` (Pal's secrets), then
  the command's own ``envs``.
- A ``secure`` sandbox's access token is derived from the server's secret and the
  sandbox's id (every replica derives the same, nothing is stored); what the E2B surface
  keeps of a sandbox besides Pal's own record is two reserved metadata keys
  (``e2b.template``, ``e2b.open``), hidden from E2B's view of the metadata.

Pal's own API keeps its defaults (``pal``, ``/workspace``): these apply only to calls
through ``/e2b`` and the agent listener.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
from collections.abc import Mapping

from pal.errors import InvalidRequest

DEFAULT_USER = "user"
ROOT = "root"
HOMES = {DEFAULT_USER: "/home/user", ROOT: "/root"}

TEMPLATE_KEY = "e2b.template"  # the template the sandbox was made of (its name as asked)
OPEN_KEY = "e2b.open"  # "true": made with secure=false (no access token)
RESERVED_PREFIX = "e2b."

# Done once when the sandbox is made, by the guest's harness with no process (the verb
# RENAME_USER, pal/guest/usernames.py): uid 1000 (the image's workload user) becomes `user`
# with home /home/user, so that `whoami`, `~` and a login shell are E2B's; its home is Pal's
# workspace (a bind mount: Pal's own files verbs serve E2B's files there in one guest
# request, and Pal's API sees the same files). A fork or a resumed sandbox has it already.


def pal_user(user: str | None) -> str | None:
    """The user Pal runs a call as for E2B's ``user`` (None: the default, ``user``)."""
    if user in (None, "", DEFAULT_USER):
        return None
    if user == ROOT:
        return ROOT
    raise InvalidRequest(f"user {user!r} does not exist in this sandbox: use '{DEFAULT_USER}' or '{ROOT}'")


def home_of(user: str | None) -> str:
    return HOMES[ROOT] if pal_user(user) == ROOT else HOMES[DEFAULT_USER]


def absolute(user: str | None, path: str) -> str:
    """``path`` as E2B resolves it: relative to the user's home; normalised."""
    if "\x00" in path:
        raise InvalidRequest("path contains a NUL byte")
    return posixpath.normpath(posixpath.join(home_of(user), path or "."))


def in_workspace(user: str | None, full: str) -> str | None:
    """``full`` as a path of Pal's workspace (what Pal's files verbs take) when the default
    user's home holds it: /home/user is /workspace (RENAME_USER's bind mount)."""
    home = HOMES[DEFAULT_USER] + "/"
    if pal_user(user) is not None or not full.startswith(home) or full == home:
        return None
    return full[len(home) :]


def process_env(sandbox_id: str, user: str | None, envs: Mapping[str, str]) -> dict[str, str]:
    name = ROOT if pal_user(user) == ROOT else DEFAULT_USER
    return {
        "E2B_SANDBOX": "true",
        "E2B_SANDBOX_ID": sandbox_id,
        "HOME": home_of(user),
        "USER": name,
        "LOGNAME": name,
        **envs,
    }


def access_token(secret: bytes, sandbox_id: str) -> str:
    """A secure sandbox's envd access token: the same on every replica, never stored."""
    return hmac.new(secret, b"e2b-access-token:" + sandbox_id.encode(), hashlib.sha256).hexdigest()


def is_secure(metadata: Mapping[str, str]) -> bool:
    return metadata.get(OPEN_KEY) != "true"


def public_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """The metadata E2B shows: the tenant's own, not the surface's reserved keys."""
    return {k: v for k, v in metadata.items() if not k.startswith(RESERVED_PREFIX)}
