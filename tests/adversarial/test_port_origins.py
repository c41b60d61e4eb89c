"""Issue 23, 1: a guest's web page never shares an origin with the dashboard, the API or
another sandbox's port.

Real Chromium (Debian's, driven by Playwright) signed in to the dashboard of a real `pal up`;
real VMs serve pages from a small HTTP server on port 8000. The guest's page is opened by
its signed link, as a person would, and its script (run in the page's own context) tries:

- to fetch the dashboard (`/runtime`) and the API with the signed-in user's cookies, read
  the CSRF token, and run a command in the user's VM with it;
- to register a service worker for the whole origin (its script answered with
  `Service-Worker-Allowed: /`), which would see the dashboard's sign-in form;
- to read another sandbox's port through its link cookie, and to set that cookie.

Each succeeds when a guest's page shares the API's origin (Pal before this fix: links were
paths of the API's origin): the positive controls below show the same calls do succeed from
the dashboard's own page. With every port on its own origin they all fail. The path route
that stays for programmatic clients is checked too: what a browser gets there is sandboxed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright

from tests.conftest import PalServer
from tests.e2e.test_dashboard import CHROMIUM_ARGS, SLOW_MS, chromium_path

pytestmark = pytest.mark.vm

DEADLINE_S = 120
GUEST_PORT = 8000
# The guest's server: a page, a service worker script that asks for the whole origin, a
# secret only its own port should give out, and the cookies it was sent.
GUEST_APP = r"""
import http.server, socketserver, sys
NAME = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        path = self.path.split("?")[0]
        extra = []
        if path.endswith("/sw.js"):
            body, ctype = b"self.addEventListener('fetch', function (e) {});", "text/javascript"
            extra = [("Service-Worker-Allowed", "/")]
        elif path.endswith("/secret"):
            body, ctype = ("secret-of-" + NAME).encode(), "text/plain"
        elif path.endswith("/cookies"):
            body, ctype = (self.headers.get("Cookie") or "").encode(), "text/plain"
        else:
            body = ("<!doctype html><title>guest</title><p id=who>" + NAME + "</p>").encode()
            ctype = "text/html"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
S(("0.0.0.0", 8000), H).serve_forever()
"""

# What a hostile page's script does with the signed-in user's browser (absolute URLs: on
# the API's origin they are same-origin, on a port's own origin cross-origin).
ATTACK = """async ([api, vm]) => {
  const out = {};
  try {
    const r = await fetch(api + "/runtime", {credentials: "include"});
    out.runtime = r.status + " " + await r.text();
  } catch (e) { out.runtime = "blocked: " + e; }
  const m = /data-csrf="([^"]+)"/.exec(out.runtime);
  out.csrf = m ? m[1] : null;
  try {
    const r = await fetch(api + "/runtime/" + vm + "/exec", {
      method: "POST", credentials: "include",
      headers: {"Content-Type": "application/json", "X-CSRF-Token": out.csrf || "none"},
      body: JSON.stringify({line: "touch /workspace/pwned"}),
    });
    out.exec = r.status + " " + await r.text();
  } catch (e) { out.exec = "blocked: " + e; }
  try {
    const r = await fetch(api + "/v1/runtime/vms", {credentials: "include"});
    out.api = r.status + " " + await r.text();
  } catch (e) { out.api = "blocked: " + e; }
  try {
    const reg = await navigator.serviceWorker.register("sw.js" + location.search, {scope: "/"});
    out.sw = reg.scope;
  } catch (e) { out.sw = "blocked: " + e; }
  return out;
}"""

# A page of one sandbox against another's port: read it with its link cookie, set that cookie.
CROSS = """async ([api, otherOrigin, otherPath]) => {
  const out = {cookie: document.cookie};
  for (const [name, url] of [["origin", otherOrigin + "/secret"], ["path", api + otherPath + "/secret"]]) {
    try {
      const r = await fetch(url, {credentials: "include"});
      out[name] = r.status + " " + await r.text();
    } catch (e) { out[name] = "blocked: " + e; }
  }
  document.cookie = "pal_link=forged; path=/; domain=localhost";
  document.cookie = "pal_link=forged; path=/";
  document.cookie = "pal_link=forged; path=" + otherPath + "/";
  return out;
}"""


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[BrowserContext]:
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
        )
        ctx.set_default_timeout(SLOW_MS)
        try:
            yield ctx
        finally:
            ctx.close()


def _serve_page(api: httpx.Client, name: str) -> str:
    """A VM of the tenant with the guest's server running; its id."""
    r = api.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    vm = str(r.json()["vmId"])
    body = {
        "command": "/bin/sh",
        "argv": ["-c", 'setsid python3 -c "$APP" "$NAME" >/tmp/guest.log 2>&1 </dev/null & echo started'],
        "env": {"APP": GUEST_APP, "NAME": name},
    }
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=body)
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    deadline = time.time() + DEADLINE_S
    while (got := api.get(f"/v1/runtime/vms/{vm}/ports/{GUEST_PORT}/secret")).status_code == 502:
        assert time.time() < deadline, "the guest's server never answered"
        time.sleep(0.3)
    assert got.text == f"secret-of-{name}", got.text
    return vm


def _link(api: httpx.Client, vm: str) -> str:
    r = api.post(f"/v1/runtime/vms/{vm}/ports/{GUEST_PORT}/url", json={"expiresInSecs": 600})
    assert r.status_code == 200, r.text
    return str(r.json()["url"])


def _sign_in(page: Page, server: PalServer, key: str) -> None:
    page.goto(server.url + "/runtime/login")
    page.fill("#api_key", key)
    page.click("#signin")
    expect(page).to_have_url(server.url + "/runtime")


@contextlib.contextmanager
def _tenant(server: PalServer, name: str) -> Iterator[tuple[str, httpx.Client]]:
    key = server.tenant(name, max_vms=3)
    api = server.client(key)
    try:
        yield key, api
    finally:
        for vm in api.get("/v1/runtime/vms").json()["vms"]:
            with contextlib.suppress(httpx.HTTPError):
                api.delete(f"/v1/runtime/vms/{vm['vmId']}")
        api.close()


def _assert_attack_failed(out: dict[str, Any], server: PalServer, where: str) -> None:
    assert out["csrf"] is None, (where, out)
    assert not out["runtime"].startswith("200"), (where, out["runtime"][:300])
    assert not out["exec"].startswith("200"), (where, out["exec"][:300])
    assert not out["api"].startswith("200"), (where, out["api"][:300])
    # A worker the guest registers on its own origin is its own business; never on Pal's.
    assert not out["sw"].startswith(server.url), (where, out["sw"])


def test_a_guest_page_cannot_use_the_signed_in_users_dashboard_or_api(
    pal_server: PalServer, tenant_key: str, browser: BrowserContext
) -> None:
    del tenant_key  # only makes sure the warm template exists
    with _tenant(pal_server, f"origins-{int(time.time())}") as (key, api):
        vm = _serve_page(api, "guest")
        page = browser.pages[0] if browser.pages else browser.new_page()
        _sign_in(page, pal_server, key)
        # Positive control: a script of the dashboard's origin does get the page and token.
        own = page.evaluate(
            ATTACK.replace("navigator.serviceWorker.register", "(() => null)"), [pal_server.url, vm]
        )
        assert own["runtime"].startswith("200") and own["csrf"], own
        assert own["exec"].startswith("200"), own["exec"][:300]
        files = f"/v1/runtime/vms/{vm}/files/content"
        assert api.get(files, params={"path": "pwned"}).status_code == 200, "the control ran the command"
        assert api.delete(files, params={"path": "pwned"}).status_code == 200

        # The guest's page, opened by its signed link as a person would.
        link = _link(api, vm)
        guest = browser.new_page()
        guest.goto(link.replace("/?", "/page.html?"))
        expect(guest.locator("#who")).to_have_text("guest")
        out = guest.evaluate(ATTACK, [pal_server.url, vm])
        _assert_attack_failed(out, pal_server, "the port's link")

        # The path route, for programmatic clients: a browser that opens it (with a link's
        # token) gets the guest's page sandboxed, in an opaque origin.
        token = link.split("palToken=", 1)[1]
        sandboxed = browser.new_page()
        path_url = f"{pal_server.url}/v1/runtime/vms/{vm}/ports/{GUEST_PORT}/page.html?palToken={token}"
        resp = sandboxed.goto(path_url)
        assert resp is not None and resp.status == 200
        out = sandboxed.evaluate(ATTACK, [pal_server.url, vm])
        _assert_attack_failed(out, pal_server, "the path route")
        assert sandboxed.evaluate("() => self.origin") == "null"

        assert api.get(files, params={"path": "pwned"}).status_code == 404, "a guest's page ran a command"
        # Nothing of the guest's controls the dashboard's origin.
        page.goto(pal_server.url + "/runtime/login")
        assert page.evaluate("async () => (await navigator.serviceWorker.getRegistrations()).length") == 0


def test_one_sandboxs_page_cannot_read_or_set_anothers_link_cookie(
    pal_server: PalServer, tenant_key: str, browser: BrowserContext
) -> None:
    del tenant_key  # only makes sure the warm template exists
    with _tenant(pal_server, f"origins-b-{int(time.time())}") as (_, api):
        a, b = _serve_page(api, "a"), _serve_page(api, "b")
        link_a, link_b = _link(api, a), _link(api, b)
        page = browser.pages[0] if browser.pages else browser.new_page()
        # B's link opened first: the browser holds B's link cookie from now on.
        page.goto(link_b.replace("/?", "/page.html?"))
        expect(page.locator("#who")).to_have_text("b")
        b_origin = link_b.split("/?", 1)[0]
        b_path = f"/v1/runtime/vms/{b}/ports/{GUEST_PORT}"
        assert page.goto(b_origin + "/secret") is not None  # the cookie alone opens B
        assert page.locator("body").inner_text() == "secret-of-b"

        # A's page tries to read B's port with B's cookie, and to set B's cookie.
        page.goto(link_a.replace("/?", "/page.html?"))
        expect(page.locator("#who")).to_have_text("a")
        out = page.evaluate(CROSS, [pal_server.url, b_origin, b_path])
        assert "secret-of-b" not in out["origin"], out
        assert "secret-of-b" not in out["path"], out
        token_b = link_b.split("palToken=", 1)[1]
        assert token_b not in out["cookie"]

        # B still opens with its own cookie, and its server never sees a forged one.
        resp = page.goto(b_origin + "/secret")
        assert resp is not None and resp.status == 200
        assert page.locator("body").inner_text() == "secret-of-b"
        page.goto(b_origin + "/cookies")
        seen = page.locator("body").inner_text()
        assert "forged" not in seen and "pal_link" not in seen, seen
