"""Issue 11, ports: reach a server inside the sandbox through the API.

Real VMs; the guest servers are stdlib Python (tests/guestservers.py): an HTTP server on
0.0.0.0:8000 (headers, echo, SSE, cookies) and a WebSocket echo server on 127.0.0.1:8001
(loopback only: reached through the harness's relay).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from pal.sdk.client import Client
from tests.conftest import PalServer, free_port, pal_cli
from tests.guestservers import APP

pytestmark = pytest.mark.vm

DEADLINE_S = 120


def start_servers(api: httpx.Client, vm: str) -> None:
    body = {
        "command": "/bin/sh",
        "argv": ["-c", 'setsid python3 -c "$APP" >/tmp/servers.log 2>&1 </dev/null & echo started'],
        "env": {"APP": APP},
    }
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=body)
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    wait_listening(api, vm, 8000)


def wait_listening(api: httpx.Client, vm: str, port: int, path: str = "/") -> httpx.Response:
    """Poll until the server in the guest answers (starting Python under TCG takes seconds)."""
    deadline = time.time() + DEADLINE_S
    while True:
        r = api.get(f"/v1/runtime/vms/{vm}/ports/{port}{path}")
        if r.status_code != 502 or time.time() > deadline:
            return r
        time.sleep(0.3)


def first_line(proc: subprocess.Popen[str]) -> str:
    """The process's first line of output, or a failure after the hang guard (a forwarder
    that never says it is ready must not hang the suite)."""
    got: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(DEADLINE_S)
    assert got, f"{proc.args} printed nothing within {DEADLINE_S} s"
    return got[0]


def ws_url(server: PalServer, vm: str, port: int, path: str, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + f"/v1/runtime/vms/{vm}/ports/{port}{path}{query}"


@pytest.fixture
def served_vm(api: httpx.Client) -> Iterator[str]:
    r = api.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        start_servers(api, vm)
        yield vm
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_http_websocket_sse_links_and_errors(
    pal_server: PalServer, api: httpx.Client, tenant_key: str, served_vm: str
) -> None:
    vm = served_vm
    base = f"/v1/runtime/vms/{vm}/ports/8000"

    # The key authorises; the guest sees the client's Host and a reverse proxy's
    # X-Forwarded-*, never the API key. On the API's origin what the guest sends is
    # sandboxed (a browser would run none of its scripts there).
    r = api.get(f"{base}/headers?x=1&y=2")
    assert r.status_code == 200, r.text
    assert r.headers["content-security-policy"] == "sandbox"
    seen = {k.lower(): v for k, v in r.json()["headers"].items()}
    assert r.json()["path"] == "/headers?x=1&y=2"
    host = pal_server.url.removeprefix("http://")
    assert seen["host"] == host
    assert seen["x-forwarded-host"] == host
    assert seen["x-forwarded-proto"] == "http"
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["x-forwarded-prefix"] == base
    assert "authorization" not in seen
    assert tenant_key not in json.dumps(r.json())

    # A body streams in and the answer out (1 MiB, chunked upload): the guest has the first
    # part while the client still holds back the rest, so the proxy did not wait for the
    # whole upload (a buffering proxy would never deliver it: the hang guard fails the test).
    payload = os.urandom(1024 * 1024)

    def upload() -> Iterator[bytes]:
        yield payload[:300_000]
        deadline = time.time() + DEADLINE_S
        while (
            api_files.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "got-first"}).status_code
            != 200
        ):
            assert time.time() < deadline, "the guest never got the first part of a streaming upload"
            time.sleep(0.2)
        yield payload[300_000:]

    with pal_server.client(tenant_key) as api_files:  # its own connection, beside the upload's
        r = api.post(f"{base}/echo?mark=got-first", content=upload())
    assert r.status_code == 200 and r.content == payload

    # The guest's cookies stay under this port's path.
    r = api.get(f"{base}/cookie")
    assert r.headers["set-cookie"] == f"app=1; Path={base}/"

    # SSE: each event arrives before the guest even produces the next one.
    with api.stream("GET", f"{base}/sse") as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        for n in (1, 2, 3):
            got = next(line for line in lines if line.startswith("data:"))
            assert got == f"data: event-{n}"
            if n < 3:
                w = api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": f"go-{n}"}, content=b"")
                assert w.status_code == 200, w.text

    # A loopback-only WebSocket server, through the relay, with the key.
    async def ws_roundtrip(url: str, headers: dict[str, str], **to: Any) -> tuple[str, bytes, str | None]:
        async with connect(url, additional_headers=headers, subprotocols=["chat"], **to) as ws:  # type: ignore[list-item]
            await ws.send("hi")
            text = await ws.recv()
            await ws.send(b"\x00\x01" * 40_000)
            data = await ws.recv()
            return str(text), bytes(data), ws.subprotocol

    auth = {"Authorization": f"Bearer {tenant_key}"}
    text, data, proto = asyncio.run(ws_roundtrip(ws_url(pal_server, vm, 8001, "/ws"), auth))
    assert (text, data, proto) == ("echo:hi", b"\x00\x01" * 40_000, "chat")

    # A signed link opens the port on its own origin without the key (and sets a cookie
    # for later requests).
    link = api.post(f"{base}/url", json={"expiresInSecs": 600}).json()
    assert link["expiresAt"] > time.time() + 500
    assert link["url"].startswith(pal_server.port_origin(vm, 8000) + "/?palToken=")
    token = link["url"].split("palToken=", 1)[1]
    with pal_server.ports_client(vm, 8000, timeout=60) as anon:
        r = anon.get(f"/headers?palToken={token}")
        assert r.status_code == 200, r.text
        assert "palToken" not in r.json()["path"]
        assert f"pal_link={token}; Path=/; HttpOnly" in r.headers["set-cookie"]
        assert "content-security-policy" not in r.headers  # the guest's own origin: not sandboxed
        r = anon.get("/headers", headers={"Cookie": f"pal_link={token}; app=1"})  # the cookie alone
        assert r.status_code == 200, r.text
        seen = {k.lower(): v for k, v in r.json()["headers"].items()}
        assert seen["cookie"] == "app=1" and seen["host"] == anon.headers["host"]
        assert "x-forwarded-prefix" not in seen  # the app is at the root of its origin
        anon.cookies.clear()
        assert anon.get("/").status_code == 401  # no link, no key
    # Bound to this VM and port: another port's origin is 401 with it.
    with pal_server.ports_client(vm, 8001, timeout=60) as other:
        assert other.get(f"/?palToken={token}").status_code == 401
    # The link opens WebSockets too (on the port's origin: the name in Host, loopback).
    link_ws = api.post(f"/v1/runtime/vms/{vm}/ports/8001/url", json={"expiresInSecs": 600}).json()
    ws_link = link_ws["url"].replace("http://", "ws://")
    to_loopback = {"host": "127.0.0.1", "port": pal_server.ports_port}
    text, _, _ = asyncio.run(ws_roundtrip(ws_link, {}, **to_loopback))
    assert text == "echo:hi"
    # An expired link is 401; a revoked one (SDK) too, while another link still opens.
    short = api.post(f"{base}/url", json={"expiresInSecs": 1}).json()
    with pal_server.ports_client(vm, 8000, timeout=60) as anon:
        short_token = short["url"].split("palToken=", 1)[1]
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline:
            try:
                r = anon.get(f"/?palToken={short_token}")
            except httpx.RemoteProtocolError:
                continue  # a response the link opened, cut as it expired (as documented): ask again
            if r.status_code != 200:
                break
            time.sleep(0.2)
        assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
        with Client(pal_server.url, tenant_key) as sdk:
            revoked = sdk.runtime.port_url(vm, 8000, 600)
            kept = sdk.runtime.port_url(vm, 8000, 600)
            assert anon.get("/", params={"palToken": _token(revoked)}).status_code == 200
            assert sdk.runtime.revoke_port_url(vm, revoked["linkId"])["revoked"] is True
        r = anon.get("/", headers={"Cookie": f"pal_link={_token(revoked)}"})
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
        assert anon.get("/", params={"palToken": _token(kept)}).status_code == 200

    # Errors: nothing listening is 502 saying so; a port outside 1-65535 is 400.
    r = api.get(f"/v1/runtime/vms/{vm}/ports/8009/")
    assert r.status_code == 502 and "nothing is listening on port 8009" in r.json()["error"]["message"]
    for bad in (0, 65536):
        assert api.get(f"/v1/runtime/vms/{vm}/ports/{bad}/").status_code == 400
    assert api.post(f"{base}/url", json={"expiresInSecs": 0}).status_code == 400

    # pal vm port-forward: curl from the host, and a WebSocket through the same forward.
    local = free_port()
    env = {**os.environ, "PAL_URL": pal_server.url, "PAL_API_KEY": tenant_key}
    fwd = subprocess.Popen(
        [sys.executable, "-m", "pal.cli.main", "vm", "port-forward", vm, "8000", "--local", str(local)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert "Forwarding" in first_line(fwd)
        out = subprocess.run(
            ["curl", "-sS", "--max-time", "60", f"http://127.0.0.1:{local}/headers"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(out.stdout)["headers"]["Host"] == f"127.0.0.1:{local}"
        ws_local = free_port()
        fwd_ws = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pal.cli.main",
                "vm",
                "port-forward",
                vm,
                "8001",
                "--local",
                str(ws_local),
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            assert "Forwarding" in first_line(fwd_ws)
            text, _, _ = asyncio.run(ws_roundtrip(f"ws://127.0.0.1:{ws_local}/", {}))
            assert text == "echo:hi"
        finally:
            fwd_ws.terminate()
            fwd_ws.wait(30)
    finally:
        fwd.terminate()
        fwd.wait(30)


def _token(link: dict[str, Any]) -> str:
    return str(link["url"]).split("palToken=", 1)[1]


def wait_paused(api: httpx.Client, vm: str) -> None:
    deadline = time.time() + DEADLINE_S
    while api.get(f"/v1/runtime/vms/{vm}").json()["state"] != "paused":
        assert time.time() < deadline, f"{vm} was not idle-suspended"
        time.sleep(0.3)


def test_port_traffic_keeps_a_vm_awake_then_an_idle_suspended_vm_wakes_for_a_port_request(
    pal_server: PalServer, api: httpx.Client, tenant_key: str
) -> None:
    r = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 2})
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    controls: list[str] = []
    stop = threading.Event()
    echoed: list[int] = []

    async def chatter() -> None:
        """WebSocket messages through the port until told to stop: the only activity."""
        auth = {"Authorization": f"Bearer {tenant_key}"}
        async with connect(ws_url(pal_server, vm, 8001, "/ws"), additional_headers=auth) as ws:
            while not stop.is_set():
                await ws.send("tick")
                assert await ws.recv() == "echo:tick"
                echoed.append(1)
                await asyncio.sleep(0.3)

    talker = threading.Thread(target=lambda: asyncio.run(chatter()))
    try:
        start_servers(api, vm)
        talker.start()
        # Two VMs with the same timeout, each scheduled after the one before was suspended:
        # once the second is suspended, more than two timeouts have passed since the busy
        # VM's last exec or file request (the guest's own claims count for at most one), so
        # only the port traffic can have kept it running.
        for _ in range(2):
            c = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 2})
            assert c.status_code == 200, c.text
            controls.append(c.json()["vmId"])
            wait_paused(api, controls[-1])
        assert talker.is_alive() and echoed, "the WebSocket traffic went on"
        assert api.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"
        stop.set()
        talker.join(DEADLINE_S)
        wait_paused(api, vm)
        r = api.get(f"/v1/runtime/vms/{vm}/ports/8000/headers")  # waits for the resume
        assert r.status_code == 200, r.text
        assert api.get(f"/v1/runtime/vms/{vm}").json()["state"] == "running"
        kinds = [e["kind"] for e in api.get(f"/v1/runtime/vms/{vm}/events").json()["events"]]
        assert "auto_resume" in kinds
        # A VM an operator paused is not woken: 409, for HTTP and for WebSockets.
        assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
        r = api.get(f"/v1/runtime/vms/{vm}/ports/8000/")
        assert r.status_code == 409 and "resume it first" in r.json()["error"]["message"]
    finally:
        stop.set()
        if talker.is_alive():
            talker.join(DEADLINE_S)
        for v in [vm, *controls]:
            api.delete(f"/v1/runtime/vms/{v}")


# A server that binds its port a while after it started (as `setsid server &` does under
# TCG): it marks /workspace/started-PORT once running, then binds DELAY seconds later.
LATE_SERVER = """
import http.server, os, time
port, delay = int(os.environ["PORT"]), float(os.environ["DELAY"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"late but there"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
open(f"started-{port}", "w").close()
time.sleep(delay)
http.server.HTTPServer(("0.0.0.0", port), H).serve_forever()
"""


def start_late_server(api: httpx.Client, vm: str, port: int, delay: float) -> None:
    """Start LATE_SERVER in the background and return once it runs (not yet listening)."""
    body = {
        "command": "/bin/sh",
        "argv": ["-c", 'setsid python3 -c "$APP" >/dev/null 2>&1 </dev/null & echo started'],
        "env": {"APP": LATE_SERVER, "PORT": str(port), "DELAY": str(delay)},
    }
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=body)
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    deadline = time.time() + DEADLINE_S  # a hang guard: Python's start under TCG
    marker = {"path": f"started-{port}"}
    while api.get(f"/v1/runtime/vms/{vm}/files/content", params=marker).status_code != 200:
        assert time.time() < deadline, "the late server never started"
        time.sleep(0.2)


def test_a_request_waits_for_a_server_that_is_still_starting(
    pal_server: PalServer, tenant_key: str, api: httpx.Client, vm: str
) -> None:
    """Issue 28, the ports race: a request sent while the guest's server has not bound its
    port yet waits for it (bounded), instead of answering 502 PORT_NOT_LISTENING at once;
    and `pal vm port-wait` waits for one that takes longer."""
    start_late_server(api, vm, 8002, 1.5)
    # The server runs but binds only in 1.5 s: the proxy waits for it.
    r = api.get(f"/v1/runtime/vms/{vm}/ports/8002/")
    assert r.status_code == 200 and r.text == "late but there", r.text

    # Longer than the proxy waits: `pal vm port-wait` returns once it listens.
    start_late_server(api, vm, 8003, 8)
    env = {**os.environ, "PAL_URL": pal_server.url, "PAL_API_KEY": tenant_key}
    cli = [sys.executable, "-m", "pal.cli.main", "--json", "vm", "port-wait", vm]
    res = subprocess.run([*cli, "8003", "--timeout", "300"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["listening"] is True
    r = api.get(f"/v1/runtime/vms/{vm}/ports/8003/")
    assert r.status_code == 200 and r.text == "late but there", r.text
    # nothing ever listens: it gives up at its timeout, saying so
    res = subprocess.run([*cli, "8009", "--timeout", "1"], capture_output=True, text=True, env=env)
    assert res.returncode == 1, res
    assert json.loads(res.stderr.strip().splitlines()[-1])["error"]["code"] == "PORT_NOT_LISTENING"


def test_a_key_rotation_ends_the_tenants_port_links(pal_server: PalServer, tenant_key: str) -> None:
    """`pal tenants rotate-key` (no grace): every link made with the old key is 401 at once;
    a link made with the new key opens the port."""
    del tenant_key  # only makes sure the warm template exists
    name = f"links-rotate-{os.getpid()}"
    key = pal_server.tenant(name, max_vms=1)
    api = pal_server.client(key)
    r = api.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        start_servers(api, vm)
        old = api.post(f"/v1/runtime/vms/{vm}/ports/8000/url", json={"expiresInSecs": 600}).json()
        with pal_server.ports_client(vm, 8000, timeout=60) as anon:
            assert anon.get("/", params={"palToken": _token(old)}).status_code == 200
            out = pal_cli("tenants", "rotate-key", name, "--data-dir", str(pal_server.data_dir))
            new_key = json.loads(out.stdout)["apiKey"]
            r = anon.get("/", headers={"Cookie": f"pal_link={_token(old)}"})
            assert r.status_code == 401 and "key rotated" in r.json()["error"]["message"]
            api.headers["Authorization"] = f"Bearer {new_key}"
            new = api.post(f"/v1/runtime/vms/{vm}/ports/8000/url", json={"expiresInSecs": 600}).json()
            assert anon.get("/", params={"palToken": _token(new)}).status_code == 200
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")
        api.close()
