"""No caller is the operator by its address, and the API answers only for its own names.

The control plane's app (API, operator routes, dashboard) is served by uvicorn on loopback,
as `pal up` builds it (pal/server.py): the operator token made in the data dir at first
start, the Host names from the listen address. Every caller here comes from 127.0.0.1, as
a local process, an escaped QEMU or a DNS-rebinding web page would.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from pal import operator
from pal.cli.main import app as cli
from pal.config import Settings
from pal.server import control_plane_app, hosts
from tests.apienv import serve
from tests.fakes import SchedEnv, make_env

SECRET = b"replicas-share-this-secret"


@dataclass
class Served:
    env: SchedEnv
    url: str
    token: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    env = make_env(tmp_path / "data")
    # As `pal up` does at start: the token in effect, the names it answers as.
    env.settings.admin_token = operator.server_token(env.settings, replica=False)
    health = {"ok": True, "accel": "tcg", "vms": 0}
    app = control_plane_app(
        env.sched, env.store, env.settings, lambda: health, SECRET, hosts(env.settings, "127.0.0.1", None)
    )
    with serve(app) as url:
        yield Served(env, url, env.settings.admin_token)
    env.store.close()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_operator_token_is_made_at_first_start_root_only(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    token = operator.server_token(settings, replica=False)
    assert token is not None and len(token) >= 32
    path = settings.keys_dir / "operator.token"
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert operator.server_token(settings, replica=False) == token  # the same at every start
    assert operator.client_token(settings) == token  # what the CLI sends
    other = Settings(data_dir=tmp_path / "other")
    assert operator.server_token(other, replica=False) != token  # random, per data dir
    path.chmod(0o644)
    with pytest.raises(Exception, match="accessible to other users"):
        operator.server_token(settings, replica=False)


def test_a_local_caller_without_the_token_is_not_the_operator(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as local:
        for method, path in (
            ("GET", "/v1/nodes"),
            ("POST", "/v1/nodes/node-1/drain"),
            ("POST", "/v1/nodes/node-1/activate"),
            ("GET", "/metrics"),
        ):
            r = local.request(method, path, json={} if method == "POST" else None)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "UNAUTHENTICATED"
            wrong = local.request(
                method, path, json={} if method == "POST" else None, headers=_bearer("nope")
            )
            assert wrong.status_code == 403, (path, wrong.text)
            tenant = local.request(
                method, path, json={} if method == "POST" else None, headers=_bearer(served.env.api_key)
            )
            assert tenant.status_code == 403, (path, tenant.text)  # a tenant key is no operator's
        assert local.get("/healthz").json() == {"ok": True}  # no internals
        assert set(local.get("/readyz").json()) == {"ready"}
        ok = local.get("/metrics", headers=_bearer(served.token))
        assert ok.status_code == 200 and "pal_tenant_slots_used" in ok.text
        details = local.get("/healthz", headers=_bearer(served.token)).json()
        assert details["accel"] == "tcg"
        nodes = local.get("/v1/nodes", headers=_bearer(served.token))
        assert nodes.status_code == 200, nodes.text


def test_the_cli_finds_the_token_in_the_data_dir(served: Served, tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"PAL_URL": served.url, "PAL_DATA_DIR": str(served.env.settings.data_dir), "PAL_ADMIN_TOKEN": ""}
    listed = runner.invoke(cli, ["node", "ls"], env=env)
    assert listed.exit_code == 0, listed.output
    assert isinstance(json.loads(listed.stdout), list)
    elsewhere = {**env, "PAL_DATA_DIR": str(tmp_path / "empty")}
    refused = runner.invoke(cli, ["node", "ls"], env=elsewhere)
    assert refused.exit_code != 0
    assert "operator token" in refused.output and "UNAUTHENTICATED" in refused.output


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:{port}",
        "localhost.evil.example",
        "[::2]",
    ],
)
def test_a_request_for_another_host_is_refused(served: Served, host: str) -> None:
    """DNS rebinding: the page's name points at 127.0.0.1, the browser still says its name."""
    named = {"Host": host.format(port=served.port)}
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for path, headers in (
            ("/v1/runtime/vms", _bearer(served.env.api_key)),
            ("/metrics", _bearer(served.token)),
            ("/v1/nodes", _bearer(served.token)),
            ("/runtime", {}),
            ("/healthz", {}),
        ):
            r = c.get(path, headers={**headers, **named})
            assert r.status_code == 421, (path, r.text)
            assert r.json()["error"]["code"] == "MISDIRECTED_REQUEST"
    # A WebSocket too: the URL's name goes into Host, the socket goes to 127.0.0.1.
    ws_url = f"ws://{named['Host']}/v1/runtime/vms/vm-x/ports/80/"
    sock = socket.create_connection(("127.0.0.1", served.port))
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(ws_url, sock=sock, additional_headers=_bearer(served.env.api_key))
    assert refused.value.response.status_code == 421


def test_a_ports_name_never_reaches_the_api_or_the_dashboard(served: Served) -> None:
    """A VM port's name (docs/ports.md) gets the ports proxy alone: with the tenant's key or
    the operator's token, the API, the operator's routes and the dashboard answer nothing."""
    named = {"Host": f"3000-vm-abc.localhost:{served.port}"}
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for path, headers in (
            ("/v1/runtime/vms", _bearer(served.env.api_key)),
            ("/metrics", _bearer(served.token)),
            ("/v1/nodes", _bearer(served.token)),
            ("/runtime", {}),
        ):
            r = c.get(path, headers={**headers, **named})
            assert r.status_code in (401, 403, 404), (path, r.status_code, r.text)
            assert "vms" not in r.json() and "nodes" not in r.json(), r.text


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "LOCALHOST.", "127.0.0.1"])
def test_the_servers_own_names_are_answered(served: Served, host: str) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.get(
            "/v1/runtime/vms", headers={"Host": host.format(port=served.port), **_bearer(served.env.api_key)}
        )
    assert r.status_code == 200, r.text


def test_pal_hosts_adds_names(tmp_path: Path) -> None:
    env = make_env(tmp_path, hosts=["pal.example.com"])
    app = control_plane_app(
        env.sched, env.store, env.settings, None, SECRET, hosts(env.settings, "0.0.0.0", None)
    )
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        for host, status in (("pal.example.com", 200), ("192.0.2.10:8080", 200), ("other.example.com", 421)):
            r = c.get("/v1/runtime/vms", headers={"Host": host, **_bearer(env.api_key)})
            assert r.status_code == status, (host, r.text)
    env.store.close()


def test_replicas_share_a_token_derived_from_the_cluster_secret(tmp_path: Path) -> None:
    """`pal server` has no data dir of its own: every replica derives the same token, the
    CLI too where it has the secret; PAL_ADMIN_TOKEN wins; without either, no one opens."""
    a = Settings(data_dir=tmp_path / "a", cluster_secret="s3cret")
    b = Settings(data_dir=tmp_path / "b", cluster_secret="s3cret")
    token = operator.server_token(a, replica=True)
    assert token and token == operator.server_token(b, replica=True) == operator.client_token(b)
    assert not (tmp_path / "a").exists()  # a replica writes nothing
    assert token != operator.server_token(Settings(cluster_secret="other"), replica=True)
    assert operator.server_token(Settings(cluster_secret="s3cret", admin_token="set"), replica=True) == "set"
    assert operator.server_token(Settings(data_dir=tmp_path / "c"), replica=True) is None
