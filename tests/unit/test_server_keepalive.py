"""Our servers keep an idle connection open well past the time a client keeps it for reuse,
so a server never closes a connection at the moment a client sends a request on it (that
request is reset: under load, a node's exec failed as 503 NODE_UNREACHABLE)."""

from __future__ import annotations

import httpx
from starlette.applications import Starlette

from pal.server import http_config


def test_a_server_keeps_idle_connections_past_an_httpx_clients_reuse_window() -> None:
    client_reuse_s = httpx.Limits().keepalive_expiry  # what HttpNode and the SDKs use
    assert client_reuse_s is not None
    cfg = http_config(Starlette(), lifespan="off")
    assert cfg.timeout_keep_alive >= 10 * client_reuse_s, cfg.timeout_keep_alive


def test_a_websocket_message_past_the_largest_frame_is_refused_by_every_server() -> None:
    """uvicorn's own default takes 16 MiB messages; ours take the largest frame any route
    uses (a port tunnel's), so a client cannot make a server buffer more before a route
    even sees it."""
    from pal.wire.tunnel import MAX_FRAME

    cfg = http_config(Starlette(), lifespan="off")
    assert cfg.ws_max_size == MAX_FRAME == 1024 * 1024
