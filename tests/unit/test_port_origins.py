"""VM ports on origins of their own, without VMs: the names, the Host dispatch, the path
route's sandbox, link cookies and revocable links, on the real API app and store with a fake
node whose "guest server" is a real HTTP server on loopback (tests/fakes.py open_port)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from pal.api.port_links import Links
from pal.api.port_origins import PortsOrigins, ports_listener_app
from pal.config import Settings
from pal.dashboard.app import install_dashboard
from pal.errors import Unauthorized
from tests.apienv import ApiEnv, make_api, serve

VM_PORT = 8000


class _Guest(http.server.BaseHTTPRequestHandler):
    """The guest's server: a page that asks for a whole-origin service worker, and an echo
    of the request's headers."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"path": self.path, "headers": dict(self.headers.items())}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if self.path.startswith("/page") else "application/json")
        self.send_header("Service-Worker-Allowed", "/")
        self.send_header("Content-Security-Policy", "default-src 'self'")
        self.send_header("Set-Cookie", "app=1; Path=/; Domain=localhost")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def guest_port() -> Iterator[int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Guest)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def env(tmp_path: Path, guest_port: int) -> ApiEnv:
    e = make_api(tmp_path)
    install_dashboard(e.app, e.sched.sched, e.sched.store, e.sched.settings, b"s" * 32)
    e.manager.port_servers[VM_PORT] = guest_port
    return e


class _c(TestClient):
    """The app in process; used as a context manager it only closes (no lifespan runs:
    nothing here needs one, and the ports listener has none)."""

    def __init__(self, app: Any, base_url: str) -> None:
        super().__init__(app, base_url=base_url)

    def __enter__(self) -> _c:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seen(r: httpx.Response) -> dict[str, str]:
    """The request headers the guest's server saw."""
    return {k.lower(): v for k, v in r.json()["headers"].items()}


def _vm(client: httpx.Client) -> str:
    r = client.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    return str(r.json()["vmId"])


def _host(vm: str, port: int = VM_PORT) -> str:
    return f"{port}-{vm}.localhost:8082"


# -- names ------------------------------------------------------------------------------------


def test_port_names_parse_only_under_the_ports_domain() -> None:
    local = PortsOrigins.from_settings(Settings())
    assert local.origin("vm-abc", 8000) == "http://8000-vm-abc.localhost:8082"
    assert local.parse("8000-vm-abc.localhost:8082") == ("vm-abc", 8000)
    assert local.parse(b"8000-VM-ABC.LOCALHOST.") == ("vm-abc", 8000)
    for other in (
        *("127.0.0.1:8080", "localhost:8080", "vm-abc.localhost", "0-vm-a.localhost", "70000-vm-a.localhost"),
        *("8000-vm-a.localhost.evil.test", "x.8000-vm-a.localhost", "[::1]:8082", ""),
    ):
        assert local.parse(other) is None, other
    real = PortsOrigins.from_settings(Settings(ports_domain="ports.example.com"))
    assert real.origin("vm-abc", 3000) == "https://3000-vm-abc.ports.example.com"
    assert real.parse("3000-vm-abc.ports.example.com") == ("vm-abc", 3000)
    assert real.parse("3000-vm-abc.localhost:8082") is None
    lab = PortsOrigins.from_settings(Settings(ports_domain="http://ports.lan:9000"))
    assert lab.origin("vm-a", 80) == "http://80-vm-a.ports.lan:9000"
    for bad in ("10.0.0.1", "https://ports.example.com/x", "ftp://ports.example.com", "com"):
        with pytest.raises(ValueError, match="PAL_PORTS_DOMAIN"):
            PortsOrigins.from_settings(Settings(ports_domain=bad))


# -- the dispatch: a port's name gets the proxy and nothing else ---------------------------------


def test_a_ports_host_never_reaches_the_dashboard_or_the_api(env: ApiEnv) -> None:
    with _c(env.app, "http://127.0.0.1:8080") as c:
        c.headers["Authorization"] = f"Bearer {env.key_a}"
        vm = _vm(c)
        # The API origin answers the API ...
        assert c.get("/v1/runtime/vms").status_code == 200
        assert c.get("/runtime/login").status_code == 200
        # ... a port's name, on the same listener, only the guest: its /runtime and /v1 are
        # the guest's paths.
        for path in ("/runtime/login", "/v1/runtime/vms", "/openapi.json", "/healthz"):
            r = c.get(path, headers={"Host": _host(vm)})
            assert r.status_code == 200, r.text
            assert r.json()["path"] == path, r.text
        # Another tenant's key opens nothing on it.
        r = c.get("/", headers={"Host": _host(vm), "Authorization": f"Bearer {env.key_b}"})
        assert r.status_code == 404


def test_the_ports_listener_serves_ports_only(env: ApiEnv) -> None:
    listener = ports_listener_app(env.app.state.ports_app, env.app.state.port_origins)
    with _c(listener, "http://127.0.0.1:8082") as c:
        for path in ("/runtime", "/runtime/login", "/v1/runtime/vms", "/healthz", "/"):
            r = c.get(path, headers={"Authorization": f"Bearer {env.key_a}"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_A_PORT", path
        with _c(env.app, "http://127.0.0.1:8080") as api:
            api.headers["Authorization"] = f"Bearer {env.key_a}"
            vm = _vm(api)
        r = c.get("/x", headers={"Host": _host(vm), "Authorization": f"Bearer {env.key_a}"})
        assert r.status_code == 200 and r.json()["path"] == "/x"


# -- what a browser gets on each origin -----------------------------------------------------------


def test_guest_content_on_the_api_origin_is_sandboxed(env: ApiEnv) -> None:
    with _c(env.app, "http://127.0.0.1:8080") as c:
        c.headers["Authorization"] = f"Bearer {env.key_a}"
        vm = _vm(c)
        r = c.get(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/page")
        assert r.status_code == 200
        assert "service-worker-allowed" not in r.headers
        # Both policies apply: the guest's own and the sandbox (opaque origin, no scripts).
        assert r.headers.get_list("content-security-policy") == ["default-src 'self'", "sandbox"]
        assert r.headers["set-cookie"] == f"app=1; Path=/v1/runtime/vms/{vm}/ports/{VM_PORT}/"
        # No link cookie is set or honoured on the API's origin.
        link = c.post(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/url", json={"expiresInSecs": 60}).json()
        token = link["url"].split("palToken=", 1)[1]
        c.headers.pop("Authorization")
        r = c.get(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/?palToken={token}")
        assert r.status_code == 200 and "pal_link" not in r.headers.get("set-cookie", "")
        r = c.get(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/", headers={"Cookie": f"pal_link={token}"})
        assert r.status_code == 401


def test_a_link_opens_its_own_origin_and_sets_a_host_only_cookie(env: ApiEnv) -> None:
    with _c(env.app, "http://127.0.0.1:8080") as c:
        c.headers["Authorization"] = f"Bearer {env.key_a}"
        vm, other = _vm(c), _vm(c)
        link = c.post(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/url", json={"expiresInSecs": 60}).json()
        assert link["url"].startswith(f"http://{_host(vm)}/?palToken=")
        token = link["url"].split("palToken=", 1)[1]
    own = {"Host": _host(vm)}
    with _c(env.app, "http://127.0.0.1:8082") as anon:
        r = anon.get(f"/page?palToken={token}&q=1", headers=own)
        assert r.status_code == 200 and r.json()["path"] == "/page?q=1"
        assert r.headers.get_list("set-cookie") == [
            "app=1; Path=/",  # the guest's, without its Domain
            f"pal_link={token}; Path=/; HttpOnly; SameSite=Lax",  # host-only: no Domain
        ]
        assert "content-security-policy: sandbox" not in str(r.headers).lower()
        cookie = {"Cookie": f"pal_link={token}; app=1"}
        r = anon.get("/page", headers={**own, **cookie})
        assert r.status_code == 200 and _seen(r)["cookie"] == "app=1", r.text
        # The link is bound to its port: another VM's name is 401 with it.
        r = anon.get("/", headers={"Host": _host(other), **cookie})
        assert r.status_code == 401
        # Cookies another origin added under the same name do not displace the valid one.
        tossed = {"Cookie": f"pal_link=forged; pal_link={token}"}
        assert anon.get("/", headers={**own, **tossed}).status_code == 200
        # The cookie authorises its own origin, navigations, and the same VM's other ports;
        # a request another origin's page makes with it is 403.
        for headers, status in (
            ({"Sec-Fetch-Site": "same-origin", "Origin": f"http://{_host(vm)}"}, 200),
            ({"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}, 200),
            ({"Sec-Fetch-Site": "same-site", "Origin": f"http://{_host(vm, 3000)}"}, 200),
            ({"Sec-Fetch-Site": "same-site", "Origin": f"http://{_host(other)}"}, 403),
            ({"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"}, 403),
            ({"Sec-Fetch-Site": "cross-site", "Origin": "http://127.0.0.1:8080"}, 403),
        ):
            r = anon.get("/", headers={**own, **cookie, **headers})
            assert r.status_code == status, (headers, r.text)


# -- links: revoked, rotated out -----------------------------------------------------------------


def test_links_are_bound_to_vm_port_and_time(env: ApiEnv) -> None:
    store = env.sched.store
    tenant = store.tenant_by_api_key(env.key_a)
    assert tenant is not None
    links = Links(b"k" * 32, store)
    now = time.time()
    link = links.sign(tenant.id, "vm-a", 8000, int(now) + 60, store_key_hash(env.key_a))
    tok = links.token(link)
    assert links.check_bounds(tok, "vm-a", 8000, now).link_id == link.link_id
    for vm, port, at, why in (
        ("vm-b", 8000, now, "another VM"),
        ("vm-a", 8001, now, "another VM or port"),
        ("vm-a", 8000, now + 61, "expired"),
    ):
        with pytest.raises(Unauthorized, match=why):
            links.check_bounds(tok, vm, port, at)
    with pytest.raises(Unauthorized, match="invalid"):
        Links(b"other-secret" * 3, store).decode(tok)
    with pytest.raises(Unauthorized, match="invalid"):
        links.decode(tok[:-2] + "xx")


def store_key_hash(key: str) -> str:
    from pal.store.store import hash_api_key

    return hash_api_key(key)


def test_a_revoked_link_and_one_from_before_a_key_rotation_are_refused(env: ApiEnv) -> None:
    api = _c(env.app, "http://127.0.0.1:8080")
    api.headers["Authorization"] = f"Bearer {env.key_a}"
    vm = _vm(api)

    def link() -> tuple[str, str]:
        got = api.post(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/url", json={"expiresInSecs": 600}).json()
        return got["url"].split("palToken=", 1)[1], got["linkId"]

    def opens(token: str) -> int:
        with _c(env.app, "http://localhost") as anon:
            by_cookie = anon.get("/", headers={"Host": _host(vm), "Cookie": f"pal_link={token}"})
            by_query = anon.get(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/?palToken={token}")
            assert by_cookie.status_code == by_query.status_code, (by_cookie.text, by_query.text)
            return by_cookie.status_code

    kept, _ = link()
    gone, gone_id = link()
    assert opens(kept) == opens(gone) == 200
    r = api.delete(f"/v1/runtime/vms/{vm}/port-links/{gone_id}")
    assert r.status_code == 200 and r.json() == {"linkId": gone_id, "revoked": True}
    assert opens(gone) == 401 and opens(kept) == 200
    assert api.delete(f"/v1/runtime/vms/{vm}/port-links/{gone_id}").status_code == 200  # again: fine
    # Only the owner revokes, only its own VMs' links; a malformed id is 400.
    other = _c(env.app, "http://127.0.0.1:8080")
    other.headers["Authorization"] = f"Bearer {env.key_b}"
    assert other.delete(f"/v1/runtime/vms/{vm}/port-links/{gone_id}").status_code == 404
    assert api.delete(f"/v1/runtime/vms/{vm}/port-links/not-an-id").status_code == 400
    assert (
        api.delete(f"/v1/runtime/vms/{vm}/port-links/{gone_id}", headers={"Authorization": ""}).status_code
        == 401
    )

    # A key rotation ends every link made with the old key (with a grace: when it ends).
    tenant = env.sched.store.tenant_by_api_key(env.key_a)
    assert tenant is not None
    env.sched.store.rotate_api_key(tenant.id, grace=timedelta(hours=1))
    assert opens(kept) == 200  # the old key still works for an hour, and so do its links
    newest = env.sched.store.rotate_api_key(tenant.id)  # no grace: every earlier key ends now
    assert opens(kept) == 401
    api.headers["Authorization"] = f"Bearer {newest}"
    fresh, _ = link()
    assert opens(fresh) == 200


def test_links_served_by_a_real_listener_pair(env: ApiEnv) -> None:
    """The ports listener as pal.server runs it: real sockets, the Host names the port."""
    listener = ports_listener_app(env.app.state.ports_app, env.app.state.port_origins)
    with serve(env.app) as api_url, serve(listener) as ports_url:  # type: ignore[arg-type]
        api = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {env.key_a}"}, timeout=30)
        vm = _vm(api)
        link = api.post(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/url", json={"expiresInSecs": 60}).json()
        path_and_query = link["url"].split("/", 3)[3]
        with httpx.Client(base_url=ports_url, timeout=30) as anon:
            r = anon.get("/" + path_and_query, headers={"Host": _host(vm)})
            assert r.status_code == 200 and _seen(r)["host"] == _host(vm)
            assert anon.get("/runtime/login").status_code == 404  # no dashboard here
        api.close()


def test_a_websocket_on_a_ports_origin_takes_its_cookie_only_from_the_same_vm(
    tmp_path: Path, guest_port: int
) -> None:
    """Browsers attach cookies to WebSocket handshakes of sibling origins and CORS does not
    apply to them: the link cookie opens a WebSocket only for pages of the same VM."""
    from websockets.sync.server import ServerConnection
    from websockets.sync.server import serve as ws_serve

    def echo(conn: ServerConnection) -> None:
        for msg in conn:
            conn.send(msg)

    e = make_api(tmp_path)
    with ws_serve(echo, "127.0.0.1", 0) as guest_ws:
        threading.Thread(target=guest_ws.serve_forever, daemon=True).start()
        e.manager.port_servers[VM_PORT] = guest_ws.socket.getsockname()[1]
        with _c(e.app, "http://127.0.0.1:8080") as api:
            api.headers["Authorization"] = f"Bearer {e.key_a}"
            vm, other = _vm(api), _vm(api)
            link = api.post(f"/v1/runtime/vms/{vm}/ports/{VM_PORT}/url", json={"expiresInSecs": 60}).json()
            token = link["url"].split("palToken=", 1)[1]
        client = _c(e.app, "ws://127.0.0.1:8082")
        cookie = {"Host": _host(vm), "Cookie": f"pal_link={token}"}
        for origin in (f"http://{_host(vm)}", f"http://{_host(vm, 3000)}"):
            with client.websocket_connect("/ws", headers={**cookie, "Origin": origin}) as ws:
                ws.send_text("hi")
                assert ws.receive_text() == "hi"
        for origin in (f"http://{_host(other)}", "http://127.0.0.1:8080", "https://evil.test"):
            with pytest.raises(WebSocketDenialResponse) as refused:
                with client.websocket_connect("/ws", headers={**cookie, "Origin": origin}):
                    pass
            assert refused.value.status_code == 403, origin
        guest_ws.shutdown()


def test_the_ports_listener_says_what_is_wrong_before_anything_starts(tmp_path: Path) -> None:
    import socket

    from pal.server import bind_ports_listener

    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = Settings(data_dir=tmp_path, ports_port=taken.getsockname()[1])
        with pytest.raises(SystemExit, match="--ports-port or PAL_PORTS_PORT"):
            bind_ports_listener(busy, "127.0.0.1", 8080)  # a port asked for is that port or none
    with pytest.raises(SystemExit, match="PAL_PORTS_DOMAIN"):
        bind_ports_listener(Settings(data_dir=tmp_path, ports_domain="10.0.0.1"), "127.0.0.1", 8080)


def test_the_ports_listener_follows_the_api_port_or_takes_a_free_one(tmp_path: Path) -> None:
    """Two servers on one machine never collide: unset, the listener is the API's port + 2,
    and a free port when that one is taken; the VM ports' links name the one it got."""
    import socket

    from pal.api.port_origins import PortsOrigins
    from pal.server import bind_ports_listener

    with socket.create_server(("127.0.0.1", 0)) as api:
        api_port = api.getsockname()[1]  # a port free a moment ago
    settings = Settings(data_dir=tmp_path)
    with bind_ports_listener(settings, "127.0.0.1", api_port - 2) as sock:
        assert sock.getsockname()[1] == settings.ports_port == api_port
        again = Settings(data_dir=tmp_path)
        with bind_ports_listener(again, "127.0.0.1", api_port - 2) as other:
            got = other.getsockname()[1]
            assert got == again.ports_port and got != api_port
            assert PortsOrigins.from_settings(again).origin("vm-1", 80).endswith(f":{got}")
