"""Fixtures of the E2B compatibility tests: Pal's E2B surface (the REST app under /e2b and
the agent listener) served on loopback, and the environment the unmodified SDKs read.

The protocol tests (test_sdk_*.py, test_connect_wire.py) serve it over the in-memory
binding of tests/e2b/fake.py: what they check is the protocol layer (what the SDKs send,
what they get back, how errors turn into their exceptions), fast. The test_real_*.py
files drive the same SDKs against a real `pal up` with real VMs (`real_e2b`): what Pal's
binding does (conventions, processes and journals, files, pause and connect), with few
sandboxes, each shared by its module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount

from pal.e2b.agent import AgentConfig, create_agent_app
from pal.e2b.envd_http import FilesConfig
from pal.e2b.keys import new_key
from pal.e2b.rest import RestConfig, create_rest_app
from tests.conftest import PalServer, pal_cli
from tests.e2b.fake import FakePal, backend

MAX_UPLOAD = 8 * 1024 * 1024


@dataclass(frozen=True)
class E2bServer:
    api_url: str
    sandbox_url: str
    key: str
    other_key: str  # another tenant's
    pal: FakePal
    loop: asyncio.AbstractEventLoop

    def env(self, key: str | None = None) -> dict[str, str]:
        return {
            "E2B_API_URL": self.api_url,
            "E2B_SANDBOX_URL": self.sandbox_url,
            "E2B_API_KEY": key or self.key,
        }


def _listen() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.set_inheritable(True)
    return sock


@pytest.fixture(scope="session")
def e2b_server() -> Iterator[E2bServer]:
    key, other = new_key(), new_key()
    pal = FakePal({key: "t-one", other: "t-two"})
    rest = create_rest_app(pal, pal.check_key, RestConfig())
    api = Starlette(routes=[Mount("/e2b", app=rest)])
    agent = create_agent_app(backend(pal), AgentConfig(files=FilesConfig(max_upload_bytes=MAX_UPLOAD)))
    api_sock, agent_sock = _listen(), _listen()
    servers = [
        uvicorn.Server(uvicorn.Config(api, log_level="warning", lifespan="off")),
        uvicorn.Server(uvicorn.Config(agent, log_level="warning", lifespan="off")),
    ]
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def main() -> None:
        tasks = [
            asyncio.create_task(servers[0].serve(sockets=[api_sock])),
            asyncio.create_task(servers[1].serve(sockets=[agent_sock])),
        ]
        while not all(s.started for s in servers):
            await asyncio.sleep(0.01)
        ready.set()
        await asyncio.gather(*tasks)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the E2B test servers did not start"
    api_port, agent_port = api_sock.getsockname()[1], agent_sock.getsockname()[1]
    yield E2bServer(
        f"http://127.0.0.1:{api_port}/e2b", f"http://127.0.0.1:{agent_port}", key, other, pal, loop
    )
    for s in servers:
        s.should_exit = True
    thread.join(30)
    api_sock.close()
    agent_sock.close()


@pytest.fixture
def e2b_env(e2b_server: E2bServer, monkeypatch: pytest.MonkeyPatch) -> E2bServer:
    """The variables `pal e2b env` prints, and nothing else of E2B's."""
    for name in ("E2B_DOMAIN", "E2B_DEBUG", "E2B_VALIDATE_API_KEY", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in e2b_server.env().items():
        monkeypatch.setenv(name, value)
    return e2b_server


# -- the same SDKs against a real `pal up` (tests/conftest.py's server, real VMs) ----------


@dataclass(frozen=True)
class RealE2b:
    """A real server's E2B surface: its /e2b and its agent listener, a tenant's E2B key
    (made as an operator makes one: `pal tenants keys add`), another tenant's."""

    server: PalServer
    key: str
    other_key: str

    def env(self, key: str | None = None) -> dict[str, str]:
        return {
            "E2B_API_URL": self.server.url + "/e2b",
            "E2B_VOLUME_API_URL": self.server.url + "/e2b",
            "E2B_SANDBOX_URL": f"http://127.0.0.1:{self.server.e2b_port}",
            "E2B_API_KEY": key or self.key,
        }


def e2b_key(server: PalServer, tenant: str) -> str:
    out = pal_cli("tenants", "keys", "add", tenant, "--name", "tests", "--data-dir", str(server.data_dir))
    return str(json.loads(out.stdout)["apiKey"])


@pytest.fixture(scope="session")
def real_e2b(pal_server: PalServer, tenant_key: str) -> RealE2b:
    del tenant_key  # tenant it-main, its template warm
    pal_server.tenant("e2b-other", max_vms=2)
    return RealE2b(pal_server, e2b_key(pal_server, "it-main"), e2b_key(pal_server, "e2b-other"))


@contextlib.contextmanager
def e2b_environ(real: RealE2b) -> Iterator[None]:
    """The variables `pal e2b env` prints, and nothing else of E2B's."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("E2B_DOMAIN", "E2B_DEBUG", "E2B_VALIDATE_API_KEY", "E2B_ACCESS_TOKEN"):
            mp.delenv(name, raising=False)
        for name, value in real.env().items():
            mp.setenv(name, value)
        yield
