"""The dashboard's Volumes pages without a browser or VMs (the real Scheduler, the node's
real volume code under tests/fakes.py): list, create, delete, and a volume's files
(browse, view, download, upload, remove), CSRF on every change, errors in words, and
another tenant's volume not found. tests/e2e/test_dashboard_volumes.py drives it in a
browser."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pal.api.app import create_app
from pal.dashboard.app import install_dashboard
from tests.fakes import SchedEnv, make_env


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[SchedEnv, httpx.AsyncClient, str, str]]:
    e = make_env(tmp_path, max_vms=2)
    _, key = e.store.create_tenant("dash-user", 2)
    _, other = e.store.create_tenant("someone-else", 2)
    app = create_app(e.sched, e.store, e.settings)
    install_dashboard(app, e.sched, e.store, e.settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        yield e, c, key, other
    await e.sched.close()
    e.store.close()


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, html
    return m.group(1)


async def _sign_in(c: httpx.AsyncClient, key: str) -> str:
    c.cookies.clear()
    page = await c.get("/runtime/login")
    resp = await c.post("/runtime/login", data={"api_key": key, "csrf": _csrf(page.text), "next": "/runtime"})
    assert resp.status_code == 303, resp.text
    return _csrf((await c.get("/runtime/volumes")).text)


async def test_the_volumes_pages(env: tuple[SchedEnv, httpx.AsyncClient, str, str]) -> None:
    _, c, key, other = env
    assert (await c.get("/runtime/volumes")).status_code == 303  # a session first
    csrf = await _sign_in(c, key)
    page = await c.get("/runtime/volumes")
    assert "No volumes yet" in page.text and 'href="/runtime/volumes"' in page.text
    h = {"X-CSRF-Token": csrf}
    assert (await c.post("/runtime/volumes/create", data={"name": "data"})).status_code == 403
    made = await c.post("/runtime/volumes/create", data={"name": "data", "sizeMib": "16"}, headers=h)
    assert made.status_code == 200 and "Created volume data" in made.text
    assert made.headers["hx-trigger"] == "volumesChanged"
    bad = await c.post("/runtime/volumes/create", data={"name": "bad name"}, headers=h)
    assert bad.status_code == 400 and "Invalid request (400)" in bad.text
    again = await c.post("/runtime/volumes/create", data={"name": "data"}, headers=h)
    assert again.status_code == 409
    rows = (await c.get("/runtime/volumes/_rows")).text
    vol_id = re.search(r'data-volume="(vol-[0-9a-f]+)"', rows)
    assert vol_id and "data" in rows and "16 MiB" in rows
    vid = vol_id.group(1)

    detail = await c.get(f"/runtime/volumes/{vid}")
    assert detail.status_code == 200 and f"/runtime/volumes/{vid}/_files" in detail.text
    up = await c.post(
        f"/runtime/volumes/{vid}/files/upload",
        data={"dir": "sub", "csrf": csrf},
        files={"file": ("<i>.txt", b"hello <script>", "text/plain")},
    )
    assert up.status_code == 200 and "Uploaded sub/&lt;i&gt;.txt" in up.text, up.text
    listing = (await c.get(f"/runtime/volumes/{vid}/_files")).text
    assert 'data-name="sub"' in listing
    inner = (await c.get(f"/runtime/volumes/{vid}/_files", params={"path": "sub"})).text
    assert "&lt;i&gt;.txt" in inner and "<i>" not in inner  # names as text
    view = await c.get(f"/runtime/volumes/{vid}/files/view", params={"path": "sub/<i>.txt"})
    assert "hello &lt;script&gt;" in view.text
    dl = await c.get(f"/runtime/volumes/{vid}/files/download", params={"path": "sub/<i>.txt"})
    assert dl.content == b"hello <script>" and "attachment" in dl.headers["content-disposition"]
    esc = await c.get(f"/runtime/volumes/{vid}/files/view", params={"path": "../x"})
    assert esc.status_code == 400 and "leaves the volume" in esc.text
    gone = await c.post(
        f"/runtime/volumes/{vid}/files/remove", data={"path": "sub", "recursive": "true"}, headers=h
    )
    assert gone.status_code == 200 and "Removed sub" in gone.text
    assert "Empty folder" in (await c.get(f"/runtime/volumes/{vid}/_files")).text

    # Another tenant: not found, from the page and from every fragment.
    await _sign_in(c, other)
    assert "No volumes yet" in (await c.get("/runtime/volumes")).text
    assert (await c.get(f"/runtime/volumes/{vid}")).status_code == 404
    assert (await c.get(f"/runtime/volumes/{vid}/_files")).status_code == 404
    assert (await c.get("/runtime/volumes/data/files/view", params={"path": "x"})).status_code == 404

    csrf = await _sign_in(c, key)
    deleted = await c.post(f"/runtime/volumes/{vid}/delete", headers={"X-CSRF-Token": csrf})
    assert deleted.status_code == 200 and "Deleted volume data" in deleted.text
    assert "No volumes yet" in (await c.get("/runtime/volumes/_rows")).text
