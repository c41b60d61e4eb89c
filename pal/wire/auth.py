"""Authentication of the node RPC over the network: a per-node token.

Each node's token is derived from the control plane's cluster secret and the node's id
(``HMAC-SHA256(secret, "pal-node:" + node_id)``), so the control plane stores no node
secrets, and a node that leaks its token exposes only itself. The operator prints a node's
token with ``pal node token NODE`` on a control-plane machine and gives it to that node
(``PAL_NODE_TOKEN``). The same token authenticates both directions: control plane -> node
RPC calls, and node -> control plane heartbeats.
"""

from __future__ import annotations

import hashlib
import hmac

from pal.errors import InvalidRequest


def node_token(cluster_secret: str, node_id: str) -> str:
    if not cluster_secret:
        raise InvalidRequest("PAL_CLUSTER_SECRET is not set: node tokens are derived from it")
    mac = hmac.new(cluster_secret.encode(), b"pal-node:" + node_id.encode(), hashlib.sha256)
    return mac.hexdigest()


def bearer_matches(header: str | None, token: str) -> bool:
    """Constant-time check of an ``Authorization: Bearer <token>`` header."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
