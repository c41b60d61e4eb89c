"""The constants of E2B's wire contract that Pal answers with (docs/e2b.md)."""

from __future__ import annotations

# The envd version Pal's agent API announces in every `Sandbox` answer. The SDKs switch
# features on by it (0.5.2 close_stdin, 0.5.7 octet-stream and gzip uploads, 0.6.2 file
# metadata, 0.6.3 watch entries, 0.6.4 network mounts): Pal serves all of them.
ENVD_VERSION = "0.6.4"

ENVD_PORT = 49983  # envd: the Connect services and /files (E2B's `ConnectionConfig.envd_port`)
INTERPRETER_PORT = 49999  # the code interpreter's /execute and /contexts

DEFAULT_TEMPLATE = "base"
# The deprecated `clientID` every Sandbox answer must carry; E2B fills in a node's id.
CLIENT_ID = "pal"

# Request headers (compared lowercased, as ASGI gives them).
SANDBOX_ID_HEADER = "e2b-sandbox-id"
SANDBOX_PORT_HEADER = "e2b-sandbox-port"
ACCESS_TOKEN_HEADER = "x-access-token"
API_KEY_HEADER = "x-api-key"
KEEPALIVE_HEADER = "keepalive-ping-interval"
# The pagination cursor of list answers (E2B's `X-Next-Token`).
NEXT_TOKEN_HEADER = "X-Next-Token"
