"""The dashboard in a real browser: Debian's chromium driven by Playwright, against a real
`pal up` with real microVMs. A person's session from sign-in to sign-out: schedule from the
list page, a streamed command in the console, a CPU spike in the usage chart, upload and
download, pause (state changes without a reload), resume, fork x2, the 402 message when the
quota is full, delete (the list hides terminated VMs); the buttons a state allows, a long
console output that keeps its first lines in view, and a port opened by a signed link.
Screenshots of the list and detail pages (laptop) and the list (phone) are written to
PAL_DASHBOARD_SCREENSHOTS (default: the test's tmp dir; docs/images holds the committed
ones)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright

from tests.conftest import PalServer
from tests.integration.test_metrics import IDLE_PCT, spike_floor

pytestmark = pytest.mark.vm

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Deadlines for conditions polled by Playwright (never fixed waits); VMs under TCG on a
# shared 2-core machine can take a while.
SLOW_MS = 180_000


def chromium_path() -> str:
    path = os.environ.get("PAL_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail("Debian's chromium is not installed: run scripts/install.sh (it installs it)")
    return path


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[BrowserContext]:
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh user-data dir
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
            accept_downloads=True,
        )
        ctx.set_default_timeout(SLOW_MS)
        expect.set_options(timeout=60_000)
        try:
            yield ctx
        finally:
            ctx.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    d = Path(os.environ.get("PAL_DASHBOARD_SCREENSHOTS") or tmp_path / "shots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _vm_from(text: str) -> str:
    m = re.search(r"vm-[0-9a-f]{24}", text)
    assert m, text
    return m.group(0)


def test_a_session_in_the_dashboard(
    pal_server: PalServer, tenant_key: str, browser: BrowserContext, shots: Path, tmp_path: Path
) -> None:
    del tenant_key  # only makes sure the warm template exists
    key = pal_server.tenant("e2e-dashboard", max_vms=3)
    api = pal_server.client(key)
    page = browser.pages[0] if browser.pages else browser.new_page()
    try:
        _session(pal_server, page, shots, tmp_path)
    finally:
        for vm in api.get("/v1/runtime/vms").json()["vms"]:
            with contextlib.suppress(httpx.HTTPError):
                api.delete(f"/v1/runtime/vms/{vm['vmId']}")
        api.close()


def _session(server: PalServer, page: Page, shots: Path, tmp_path: Path) -> None:
    key = server.keys["e2e-dashboard"]
    # -- sign in ------------------------------------------------------------------------------
    page.goto(server.url + "/runtime")
    expect(page).to_have_url(re.compile(r"/runtime/login"))
    page.fill("#api_key", "pal_not-a-key")
    page.click("#signin")
    expect(page.locator(".msg.err")).to_contain_text("not valid")
    page.fill("#api_key", key)
    page.click("#signin")
    expect(page).to_have_url(server.url + "/runtime")
    expect(page.locator(".who")).to_have_text("e2e-dashboard")

    # -- schedule from the list page; the row appears by polling ----------------------------------
    page.click("#schedule-btn")
    msg = page.locator("#schedule-msg .msg")
    expect(msg).to_contain_text("Scheduled vm-", timeout=SLOW_MS)
    vm = _vm_from(msg.inner_text())
    row = page.locator(f'tr[data-vm="{vm}"]')
    expect(row.locator(".state")).to_have_text("running")
    page.click(f'a[href="/runtime/{vm}"]')
    expect(page.locator("#vm-state")).to_have_text("running")

    # -- only the actions the state allows are enabled (the scheduler's transition table) -----------
    expect(page.locator("#btn-pause")).to_be_enabled()
    expect(page.locator("#btn-resume")).to_be_disabled()
    expect(page.locator("#btn-delete")).to_be_enabled()

    # -- the console streams output as it comes, then the exit code --------------------------------
    page.fill("#console-line", "for i in 1 2 3; do echo tick $i; sleep 1; done; echo oops >&2; exit 3")
    page.click("#console-run")
    expect(page.locator("#console-out")).to_contain_text("tick 1")
    # streamed: the first line is shown while the command still runs
    assert "exit code" not in page.locator("#console-status").inner_text()
    expect(page.locator("#console-status")).to_have_text("exit code 3")
    expect(page.locator("#console-out .stderr")).to_have_text("oops\n")
    assert "tick 3" in page.locator("#console-out").inner_text()

    # -- a long output keeps its first lines in view (the console does not jump to the end) ---------
    page.fill("#console-line", "seq 1 300")
    page.click("#console-run")
    expect(page.locator("#console-status")).to_have_text("exit code 0")
    out = page.locator("#console-out")
    assert out.evaluate("el => el.scrollHeight > el.clientHeight"), "300 lines overflow the console"
    assert out.evaluate("el => el.scrollTop") == 0
    first, box = out.locator(".cmd").bounding_box(), out.bounding_box()
    assert first and box, (first, box)
    assert box["y"] <= first["y"] and first["y"] + first["height"] <= box["y"] + box["height"], (first, box)
    # scrolled to the end by the reader, it follows new output there
    page.fill("#console-line", "seq 1 300; sleep 2; echo the-end")
    page.click("#console-run")
    page.wait_for_function("() => document.getElementById('console-out').textContent.includes('\\n300\\n')")
    out.evaluate("el => { el.scrollTop = el.scrollHeight; }")
    expect(page.locator("#console-status")).to_have_text("exit code 0")
    assert out.evaluate("el => el.scrollTop + el.clientHeight >= el.scrollHeight - 4"), "not following"

    # a server for the port link below (started now: Python takes a while to start under TCG)
    page.fill("#console-line", "setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null & echo started")
    page.click("#console-run")
    expect(page.locator("#console-status")).to_have_text("exit code 0")

    # -- files: browse, upload, view, download --------------------------------------------------------
    page.click("#files-open")
    expect(page.locator("#files .path")).to_have_text("/workspace/")
    content = b"hello from the browser\n<not markup>\n"
    page.set_input_files("#upload-file", {"name": "notes.txt", "mimeType": "text/plain", "buffer": content})
    page.click("#upload-btn")
    expect(page.locator("#files-msg .msg.ok")).to_contain_text("Uploaded notes.txt (36 bytes)")
    entry = page.locator('#files li[data-name="notes.txt"]')
    expect(entry).to_have_count(1)
    entry.locator("a.view").click()
    expect(page.locator("#file-text")).to_have_text(content.decode())
    with page.expect_download() as dl:
        entry.locator("a.download").click()
    target = tmp_path / "downloaded.txt"
    dl.value.save_as(target)
    assert target.read_bytes() == content

    # -- a port: a signed link from the page opens the VM's server in a new tab ------------------------
    page.fill("#port-number", "8000")
    page.click("#port-open")
    link = page.locator("#port-msg a#port-link")
    # The port's own origin (docs/ports.md): never the dashboard's.
    expect(link).to_have_attribute("href", re.compile(rf"^http://8000-{vm}\.localhost:\d+/\?palToken="))
    with page.context.expect_page() as opened:
        link.click()
    tab = opened.value
    tab.wait_for_load_state()
    for _ in range(60):  # a hang guard: the server may still be starting under TCG
        if "notes.txt" in tab.content():
            break
        tab.reload()
    expect(tab.locator("body")).to_contain_text("notes.txt")  # http.server lists /workspace
    tab.close()

    # -- a CPU spike in the usage chart --------------------------------------------------------------
    # The idle guest first (its CPU settles after the restore and the commands above), then
    # 5 s of sha256sum: the chart (y from 0) shows the spike.
    chart = page.locator("#chart-cpu")
    expect(chart.locator("canvas")).to_have_count(1)
    page.wait_for_function(
        "idle => { const d = document.getElementById('chart-cpu').dataset; "
        "return d.last !== undefined && d.last !== '' && parseFloat(d.last) < idle; }",
        arg=IDLE_PCT,
    )
    idle = float(chart.get_attribute("data-last") or "0")
    idle_t = int(chart.get_attribute("data-last-t") or "0")
    page.fill("#console-line", "timeout 5 sha256sum /dev/zero; echo burnt")
    page.click("#console-run")
    expect(page.locator("#console-status")).to_have_text("exit code 0", timeout=SLOW_MS)
    burnt_ms = int(page.evaluate("Date.now()"))
    # the chart has drawn a sample taken after the burn ended
    page.wait_for_function(
        "t => parseInt(document.getElementById('chart-cpu').dataset.lastT || '0') > t", arg=burnt_ms
    )
    body = page.evaluate(f"fetch('/runtime/{vm}/metrics.json').then(r => r.json())")
    burst = [x["cpuPct"] for x in body["samples"] if x["t"] > idle_t and x["cpuPct"] is not None]
    assert max(burst) >= spike_floor(idle), (idle, burst)
    assert float(chart.get_attribute("data-peak") or "0") >= max(burst)  # what the chart drew
    page.screenshot(path=str(shots / "dashboard-detail.png"), full_page=True)

    # -- pause: the state changes on the page without a reload ----------------------------------------
    page.evaluate("window.__palNoReload = true")
    page.click("#btn-pause")
    expect(page.locator("#vm-state")).to_have_text("paused", timeout=SLOW_MS)
    expect(page.locator("#action-msg .msg.ok")).to_contain_text("Paused")
    expect(page.locator("#btn-pause")).to_be_disabled()
    expect(page.locator("#btn-resume")).to_be_enabled()
    assert page.evaluate("window.__palNoReload === true")
    expect(page.locator("#snapshots table tbody tr")).to_have_count(1)
    expect(page.locator("#timeline")).to_contain_text("paused by operator")

    page.click("#btn-resume")
    expect(page.locator("#vm-state")).to_have_text("running", timeout=SLOW_MS)
    expect(page.locator("#btn-resume")).to_be_disabled()

    # -- fork x2: two children appear ------------------------------------------------------------------
    page.fill("#fork-count", "2")
    page.click("#btn-fork")
    expect(page.locator("#action-msg .msg.ok")).to_contain_text("Forked 2", timeout=SLOW_MS)
    expect(page.locator("#children li")).to_have_count(2)
    expect(page.locator("#children li .state")).to_have_text(["running", "running"])
    child = page.locator("#children li a").first.inner_text()
    assert page.evaluate("window.__palNoReload === true")

    # -- the quota is full (3 of 3): scheduling answers 402 in words ---------------------------------------
    page.click('a[href="/runtime"]')
    expect(page.locator("#rows tr[data-vm]")).to_have_count(3)
    page.click("#schedule-btn")
    expect(page.locator("#schedule-msg .msg.err")).to_contain_text("Quota exhausted (402)")
    page.select_option("#state", "paused")
    expect(page.locator("#rows tr.empty")).to_have_count(1)
    page.select_option("#state", "active")
    page.fill("#q", child[:14])  # a child: matches its own row only
    expect(page.locator("#rows tr[data-vm]")).to_have_count(1)
    page.fill("#q", vm)  # the parent: its row and its children's (search covers the parent column)
    expect(page.locator("#rows tr[data-vm]")).to_have_count(3)
    page.fill("#q", "")
    expect(page.locator("#rows tr[data-vm]")).to_have_count(3)
    page.screenshot(path=str(shots / "dashboard-list.png"), full_page=True)

    # -- on a phone: nothing wider than the screen ---------------------------------------------------------
    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    expect(page.locator("#rows tr[data-vm]")).to_have_count(3)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    page.screenshot(path=str(shots / "dashboard-phone.png"), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 900})

    # -- delete a child (confirmed in a dialog): the list hides it, terminated, by default ---------------
    page.goto(server.url + f"/runtime/{child}")
    page.once("dialog", lambda d: d.accept())
    page.click("#btn-delete")
    expect(page.locator("#action-msg .msg.ok")).to_contain_text("Deleted (terminated)", timeout=SLOW_MS)
    expect(page.locator("#vm-state")).to_have_text("terminated")
    page.click('a[href="/runtime"]')
    expect(page.locator("#rows tr[data-vm]")).to_have_count(2)
    expect(page.locator(f'#rows tr[data-vm="{child}"]')).to_have_count(0)
    page.select_option("#state", "terminated")
    expect(page.locator(f'#rows tr[data-vm="{child}"] .state')).to_have_text("terminated")

    # -- sign out -------------------------------------------------------------------------------------------
    page.click("#signout")
    expect(page).to_have_url(re.compile(r"/runtime/login"))
    page.goto(server.url + "/runtime")
    expect(page).to_have_url(re.compile(r"/runtime/login"))
    for name in ("dashboard-detail.png", "dashboard-list.png", "dashboard-phone.png"):
        assert (shots / name).stat().st_size > 10_000, name
