"""The dashboard's server side without a browser or VMs: sign-in, the session cookie's flags,
CSRF refusals, pages and fragments, actions answering 402/409 in words (on the real
Scheduler with the fake runtime manager). The browser test (tests/e2e) drives the rest."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pal.api.app import create_app
from pal.dashboard.app import install_dashboard
from pal.spec import AgentSpec
from tests.fakes import SchedEnv, make_env


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[SchedEnv, httpx.AsyncClient, str]]:
    e = make_env(tmp_path, max_vms=2)
    _, key = e.store.create_tenant("dash-user", 2)
    app = create_app(e.sched, e.store, e.settings)
    install_dashboard(app, e.sched, e.store, e.settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        yield e, c, key
    await e.sched.close()
    e.store.close()


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, html
    return m.group(1)


async def _sign_in(c: httpx.AsyncClient, key: str) -> str:
    page = await c.get("/runtime/login")
    resp = await c.post("/runtime/login", data={"api_key": key, "csrf": _csrf(page.text), "next": "/runtime"})
    assert resp.status_code == 303 and resp.headers["location"] == "/runtime", resp.text
    listing = await c.get("/runtime")
    assert listing.status_code == 200
    return _csrf(listing.text)


async def test_pages_need_a_session_and_sign_in_sets_a_strict_httponly_cookie(
    env: tuple[SchedEnv, httpx.AsyncClient, str],
) -> None:
    _, c, key = env
    resp = await c.get("/runtime?state=paused")
    assert (
        resp.status_code == 303
        and resp.headers["location"] == "/runtime/login?next=/runtime%3Fstate%3Dpaused"
    )
    frag = await c.get("/runtime/_rows")
    assert frag.status_code == 401 and frag.headers["hx-redirect"] == "/runtime/login"

    page = await c.get("/runtime/login")
    bad = await c.post("/runtime/login", data={"api_key": "pal_wrong", "csrf": _csrf(page.text)})
    assert bad.status_code == 401 and "not valid" in bad.text
    forged = await c.post("/runtime/login", data={"api_key": key, "csrf": "guess"})
    assert forged.status_code == 403

    page = await c.get("/runtime/login")
    ok = await c.post(
        "/runtime/login", data={"api_key": key, "csrf": _csrf(page.text), "next": "//evil.example/"}
    )
    assert ok.status_code == 303 and ok.headers["location"] == "/runtime"  # no open redirect
    cookie = next(
        v for k, v in ok.headers.multi_items() if k == "set-cookie" and v.startswith("pal_session=")
    )
    flags = cookie.lower()
    assert "httponly" in flags and "samesite=strict" in flags and "path=/runtime" in flags
    assert key not in cookie  # the API key is never stored in the browser
    listing = await c.get("/runtime")
    assert listing.status_code == 200 and "Sandboxes" in listing.text
    assert "script-src 'self'" in listing.headers["content-security-policy"]
    # the REST API does not take the cookie instead of a key
    assert (await c.get("/v1/runtime/vms")).status_code == 401


async def test_actions_need_the_csrf_token_and_show_errors_in_words(
    env: tuple[SchedEnv, httpx.AsyncClient, str],
) -> None:
    e, c, key = env
    token = await _sign_in(c, key)
    forged = await c.post("/runtime/schedule", data={"memoryMib": "256"})
    assert forged.status_code == 403 and "Not allowed (403)" in forged.text
    assert e.manager.spawn_requests == []  # refused before anything happened

    hdr = {"X-CSRF-Token": token}
    first = await c.post("/runtime/schedule", data={"memoryMib": "256", "vcpus": "1"}, headers=hdr)
    assert first.status_code == 200 and "Scheduled vm-" in first.text
    assert first.headers["hx-trigger"] == "vmsChanged"
    vm = re.search(r"(vm-[0-9a-f]+)", first.text).group(1)  # type: ignore[union-attr]
    await c.post("/runtime/schedule", data={}, headers=hdr)
    full = await c.post("/runtime/schedule", data={}, headers=hdr)
    assert full.status_code == 402 and "Quota exhausted (402)" in full.text

    rows = await c.get("/runtime/_rows", params={"state": "running", "q": vm[:10]})
    assert vm in rows.text and rows.text.count("<tr") == 1
    detail = await c.get(f"/runtime/{vm}")
    assert detail.status_code == 200 and 'id="vm-state">running' in detail.text

    assert "Paused" in (await c.post(f"/runtime/{vm}/pause", headers=hdr)).text
    again = await c.post(f"/runtime/{vm}/pause", headers=hdr)
    assert again.status_code == 409 and "Not possible in this state (409)" in again.text
    state = await c.get(f"/runtime/{vm}/_state")
    assert 'id="vm-state">paused' in state.text
    snaps = await c.get(f"/runtime/{vm}/_snapshots")
    assert "4.0 KiB" in snaps.text  # the fake manager's mem size
    timeline = await c.get(f"/runtime/{vm}/_timeline")
    assert "running → draining" in timeline.text and "paused by operator" in timeline.text
    fork = await c.post(f"/runtime/{vm}/fork", data={"count": "2"}, headers=hdr)
    assert fork.status_code == 402  # one slot left, two asked: all or nothing
    assert "Resumed (running)." in (await c.post(f"/runtime/{vm}/resume", headers=hdr)).text
    assert "Deleted (terminated)." in (await c.post(f"/runtime/{vm}/delete", headers=hdr)).text
    gone = await c.post(f"/runtime/{vm}/resume", headers=hdr)
    assert gone.status_code == 409 and "cannot resume" in gone.text

    other = await c.get("/runtime/vm-" + "0" * 24)
    assert other.status_code == 404 and "Not found (404)" in other.text


async def test_files_exec_and_sign_out(env: tuple[SchedEnv, httpx.AsyncClient, str]) -> None:
    _, c, key = env
    token = await _sign_in(c, key)
    hdr = {"X-CSRF-Token": token}
    vm = re.search(r"(vm-[0-9a-f]+)", (await c.post("/runtime/schedule", headers=hdr)).text).group(1)  # type: ignore[union-attr]

    up = await c.post(
        f"/runtime/{vm}/files/upload",
        data={"dir": "", "csrf": token},
        files={"file": ("notes.txt", b"<b>hi</b>")},
    )
    assert up.status_code == 200 and "Uploaded notes.txt (9 bytes)" in up.text
    big = await c.post(
        f"/runtime/{vm}/files/upload",
        data={"csrf": token},
        files={"file": ("big.bin", b"x" * (1024 * 1024 + 1))},
    )
    assert big.status_code == 413 and "Too large (413)" in big.text
    huge = await c.post(  # refused from its Content-Length, before the form is parsed
        f"/runtime/{vm}/files/upload", data={"csrf": token}, files={"file": ("huge.bin", b"x" * (3 << 20))}
    )
    assert huge.status_code == 413 and huge.text.startswith('<p class="msg err"')
    listing = await c.get(f"/runtime/{vm}/_files")
    assert 'data-name="notes.txt"' in listing.text
    view = await c.get(f"/runtime/{vm}/files/view", params={"path": "notes.txt"})
    assert "&lt;b&gt;hi&lt;/b&gt;" in view.text  # shown as text, never as markup
    dl = await c.get(f"/runtime/{vm}/files/download", params={"path": "notes.txt"})
    assert dl.content == b"<b>hi</b>" and dl.headers["content-disposition"].startswith("attachment")
    escape = await c.get(f"/runtime/{vm}/files/view", params={"path": "../etc/passwd"})
    assert escape.status_code == 400

    run = await c.post(
        f"/runtime/{vm}/exec", json={"line": "echo hi"}, headers={**hdr, "Accept": "text/event-stream"}
    )
    assert run.status_code == 200 and "event: stdout" in run.text and "event: exit" in run.text
    assert (await c.post(f"/runtime/{vm}/exec", json={"line": "echo hi"})).status_code == 403  # no token

    metrics = (await c.get(f"/runtime/{vm}/metrics.json")).json()
    assert metrics["vmId"] == vm and len(metrics["samples"]) == 3

    out = await c.post("/runtime/logout", data={"csrf": token})
    assert out.status_code == 303 and out.headers["location"] == "/runtime/login"
    assert (await c.get("/runtime")).status_code == 303  # the session is gone


def test_a_replica_derives_its_session_key_from_the_cluster_secret_and_writes_no_file(
    tmp_path: Path,
) -> None:
    """`pal server` has no data dir: a key file there once left a non-empty /var/lib/pal
    behind that `pal up` could not mount its XFS on. Replicas sharing the cluster secret
    share the key; without either secret the replica refuses to start."""
    from pal.config import Settings
    from pal.dashboard.session import load_secret

    data = tmp_path / "never-made"
    a = Settings(data_dir=data, cluster_secret="s1")
    assert load_secret(a, replica=True) == load_secret(
        Settings(data_dir=data, cluster_secret="s1"), replica=True
    )
    assert load_secret(a, replica=True) != load_secret(
        Settings(data_dir=data, cluster_secret="s2"), replica=True
    )
    assert not data.exists()
    with pytest.raises(ValueError, match="PAL_CLUSTER_SECRET"):
        load_secret(Settings(data_dir=data), replica=True)
    assert load_secret(Settings(data_dir=data), replica=False) == (data / "dashboard.key").read_bytes()


async def test_a_session_ends_when_its_api_key_no_longer_opens_the_tenant(
    env: tuple[SchedEnv, httpx.AsyncClient, str],
) -> None:
    """Signing out deletes the cookie; rotating the key (past its grace) ends every session
    opened with it, even a copied cookie."""
    sched, c, key = env
    await _sign_in(c, key)
    assert (await c.get("/runtime")).status_code == 200
    copied = dict(c.cookies)
    tenant = sched.store.tenant_by_api_key(key)
    assert tenant is not None
    sched.store.rotate_api_key(tenant.id)  # no grace: the old key is refused at once
    resp = await c.get("/runtime")
    assert resp.status_code == 303 and resp.headers["location"].startswith("/runtime/login")
    c.cookies.clear()
    c.cookies.update(copied)
    assert (await c.get("/runtime")).status_code == 303, "a copied cookie is no better"


def _enabled(html: str) -> dict[str, bool]:
    """Which of the VM's buttons are enabled in a page or fragment."""
    out = {}
    for name in ("pause", "resume", "delete"):
        m = re.search(rf'<button[^>]*id="btn-{name}"[^>]*>', html, re.S)
        assert m, html
        out[name] = " disabled" not in m.group(0)
    return out


async def test_buttons_follow_the_transition_table_and_a_port_gets_a_signed_link(
    env: tuple[SchedEnv, httpx.AsyncClient, str],
) -> None:
    _, c, key = env
    token = await _sign_in(c, key)
    hdr = {"X-CSRF-Token": token}
    vm = re.search(r"(vm-[0-9a-f]+)", (await c.post("/runtime/schedule", headers=hdr)).text).group(1)  # type: ignore[union-attr]
    assert _enabled((await c.get(f"/runtime/{vm}")).text) == {"pause": True, "resume": False, "delete": True}
    await c.post(f"/runtime/{vm}/pause", headers=hdr)
    paused = (await c.get(f"/runtime/{vm}/_state")).text
    assert _enabled(paused) == {"pause": False, "resume": True, "delete": True}
    await c.post(f"/runtime/{vm}/delete", headers=hdr)
    gone = (await c.get(f"/runtime/{vm}/_state")).text
    assert _enabled(gone) == {"pause": False, "resume": False, "delete": False}

    # the port form: the REST route's signed link, for this VM and port
    vm = re.search(r"(vm-[0-9a-f]+)", (await c.post("/runtime/schedule", headers=hdr)).text).group(1)  # type: ignore[union-attr]
    forged = await c.post(f"/runtime/{vm}/port-link", data={"port": "8000"})
    assert forged.status_code == 403
    got = await c.post(f"/runtime/{vm}/port-link", data={"port": "8000", "csrf": token})
    assert got.status_code == 200, got.text
    url = re.search(r'id="port-link" href="([^"]+)"', got.text).group(1)  # type: ignore[union-attr]
    assert url.startswith(f"http://8000-{vm}.localhost:8082/?palToken="), url  # the port's own origin
    assert 'target="_blank"' in got.text and "noopener" in got.text
    for bad in ("0", "65536", "http"):
        r = await c.post(f"/runtime/{vm}/port-link", data={"port": bad, "csrf": token})
        assert r.status_code == 400 and "port from 1 to 65535" in r.text, r.text
    other = await c.post("/runtime/vm-" + "0" * 24 + "/port-link", data={"port": "80", "csrf": token})
    assert other.status_code == 404


async def test_the_terminal_needs_csrf_and_pages_admit_only_their_own_style_nonce(
    env: tuple[SchedEnv, httpx.AsyncClient, str],
) -> None:
    """The VM page's terminal (pal/dashboard/terminal.py): its link needs the CSRF token;
    each page's CSP admits the <style> elements of its own random nonce only (xterm.js
    writes its layout into such elements), never inline styles in general."""
    _, c, key = env
    token = await _sign_in(c, key)
    hdr = {"X-CSRF-Token": token}
    vm = re.search(r"(vm-[0-9a-f]+)", (await c.post("/runtime/schedule", headers=hdr)).text).group(1)  # type: ignore[union-attr]
    nonces = []
    for _ in range(2):
        page = await c.get(f"/runtime/{vm}")
        csp = page.headers["content-security-policy"]
        m = re.search(r"style-src 'self' 'nonce-([A-Za-z0-9_-]{16,})';", csp)
        assert m, csp
        assert "unsafe-inline" not in csp and "script-src 'self';" in csp
        assert f'data-style-nonce="{m.group(1)}"' in page.text
        assert 'src="/runtime/static/vendor/xterm-' in page.text and 'id="terminal-open"' in page.text
        nonces.append(m.group(1))
    assert nonces[0] != nonces[1]
    forged = await c.post(f"/runtime/{vm}/terminal", json={"cols": 80, "rows": 24})
    assert forged.status_code == 403
    other = await c.post("/runtime/vm-" + "0" * 24 + "/terminal", json={"cols": 80, "rows": 24}, headers=hdr)
    assert other.status_code == 404
    bad = await c.post(f"/runtime/{vm}/terminal", json={"cols": 0, "rows": 24}, headers=hdr)
    assert bad.status_code == 400
    # the vendored files the page names are served (scripts/vendor-xterm.sh put them there)
    for name in ("xterm.js", "xterm.css", "addon-fit.js"):
        src = re.search(rf'"(/runtime/static/vendor/xterm-[0-9.]+/{name})"', page.text)
        assert src, name
        assert (await c.get(src.group(1))).status_code == 200


async def test_the_timeline_comes_a_page_at_a_time_newest_first(
    env: tuple[SchedEnv, httpx.AsyncClient, str],
) -> None:
    """A VM's log is never loaded whole: the polled fragment is its newest page, with a
    button for the page before it, and so on to the first event."""
    e, c, key = env
    await _sign_in(c, key)
    tenant = e.store.tenant_by_api_key(key)
    assert tenant is not None
    vm = (await e.sched.scheduling.schedule(tenant.id, AgentSpec()))[0].vm_id
    for i in range(120):
        e.store.add_event(vm, tenant.id, "mcp_tool", reason=f"call {i:03d}")
    seen: list[str] = []
    url, first = f"/runtime/{vm}/_timeline", True
    while True:
        page = (await c.get(url)).text
        reasons = re.findall(r"call (\d{3})", page)
        assert len(reasons) <= 50 and reasons == sorted(reasons, reverse=True)
        seen += reasons
        more = re.search(r'hx-get="(/runtime/[^"]+_timeline\?before=\d+)"', page)
        if more is None:
            break
        assert ('hx-target="#timeline-older"' in page) is first
        url, first = more.group(1), False
    assert seen == [f"{i:03d}" for i in reversed(range(120))]
