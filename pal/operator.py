"""The operator's token: what opens the operator's routes (``/v1/nodes``, ``/metrics``, the
details of ``/healthz`` and ``/readyz``). No caller is the operator by its address: a local
process, an escaped QEMU (it runs in the host's network namespace) or a web page that
rebinds a name to 127.0.0.1 all come from loopback.

Which token the server takes, in order:

- ``PAL_ADMIN_TOKEN`` when set (a cluster sets it on every replica);
- ``pal up``: ``<data dir>/keys/operator.token``, made at first start (0600, root's, like
  the other keys: pal/keyfile.py);
- ``pal server`` (no data dir of its own): derived from ``PAL_CLUSTER_SECRET``, which every
  replica shares, so a token forwarded by a follower opens the leader too.

The ``pal`` CLI finds it the same way (``PAL_ADMIN_TOKEN``, else the data dir's file, which
root may read, else the derivation), so ``pal node ls`` and ``pal doctor`` run as root on
the host need nothing set.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from pal import keyfile
from pal.config import Settings

TOKEN_FILE = "operator.token"


def token_path(settings: Settings) -> Path:
    return settings.keys_dir / TOKEN_FILE


def derived_token(cluster_secret: str) -> str:
    """The operator token of replicas without ``PAL_ADMIN_TOKEN``."""
    return hmac.new(cluster_secret.encode(), b"pal-operator-token", hashlib.sha256).hexdigest()


def server_token(settings: Settings, replica: bool) -> str | None:
    """The token this server takes (made on first start for ``pal up``); None only for a
    replica with neither ``PAL_ADMIN_TOKEN`` nor ``PAL_CLUSTER_SECRET``: its operator
    routes then open for no one."""
    if settings.admin_token:
        return settings.admin_token
    if replica:
        return derived_token(settings.cluster_secret) if settings.cluster_secret else None
    return keyfile.load_or_create_token(token_path(settings))


def client_token(settings: Settings) -> str | None:
    """The token the CLI sends: ``PAL_ADMIN_TOKEN``, else the data dir's file (never made
    here), else derived from ``PAL_CLUSTER_SECRET``; None when none is at hand."""
    if settings.admin_token:
        return settings.admin_token
    try:
        text = token_path(settings).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if text:
        return text
    return derived_token(settings.cluster_secret) if settings.cluster_secret else None
