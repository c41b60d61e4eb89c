"""The REST API on the real Scheduler and store with a fake runtime manager
(tests/fakes.py), for the API, SDK and CLI unit tests; and a real uvicorn server on
loopback (the only way to see SSE chunks arrive before a command ends: httpx's ASGI
transport buffers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from pal.api.app import create_app
from tests.fakes import FakeManager, SchedEnv, make_env


@dataclass
class ApiEnv:
    app: FastAPI
    sched: SchedEnv
    key_a: str  # tenant "acme", quota max_vms
    key_b: str  # tenant "bob", same quota

    @property
    def manager(self) -> FakeManager:
        return self.sched.manager


def make_api(
    tmp: Path,
    *,
    max_vms: int = 2,
    health: Any = None,
    ready: Any = None,
    hosts: tuple[str, ...] = (),
    host_checks: Any = None,
) -> ApiEnv:
    """``hosts``: names the API answers as besides the loopback ones (PAL_HOSTS);
    ``host_checks``: the server's host rows (GET /v1/operator/host; None: it runs no VMs)."""
    env = make_env(tmp, max_vms=max_vms)
    env.settings.hosts = list(hosts)
    _, key_b = env.store.create_tenant("bob", max_vms)
    app = create_app(env.sched, env.store, env.settings, health=health, ready=ready, host_checks=host_checks)
    return ApiEnv(app, env, env.api_key, key_b)


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` on an ephemeral loopback port in a thread; yields its base URL and
    always stops the server."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "test server did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
