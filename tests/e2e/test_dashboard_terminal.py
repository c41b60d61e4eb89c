"""The VM page's terminal in a real browser (Debian's chromium, Playwright) against a real
`pal up`: xterm.js served by Pal, a shell attached over the WebSocket attach. Typing a
command and seeing its output, `top` drawing its full screen, a window resize reaching
`stty size`, a pause ending the attachment with `detached` and a reattach going on where
it stopped, and no style or script refused by the page's CSP on the way."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import BrowserContext, Page, expect

from tests.conftest import PalServer
from tests.e2e.test_dashboard import SLOW_MS, browser, shots  # noqa: F401  (fixtures)

pytestmark = pytest.mark.vm


def screen(page: Page) -> str:
    return page.locator("#terminal .xterm-rows").inner_text()


def wait_screen(page: Page, pattern: str) -> None:
    """Until the terminal shows text matching ``pattern`` (a regex)."""
    rows = page.locator("#terminal .xterm-rows")
    expect(rows).to_contain_text(re.compile(pattern), timeout=SLOW_MS)


def run(page: Page, line: str) -> None:
    page.locator("#terminal .xterm-helper-textarea").focus()
    page.keyboard.type(line)
    page.keyboard.press("Enter")


def test_the_vm_page_terminal(
    pal_server: PalServer,
    tenant_key: str,
    browser: BrowserContext,  # noqa: F811
    shots: Path,  # noqa: F811
) -> None:
    del tenant_key  # only makes sure the warm template exists
    key = pal_server.tenant("e2e-terminal", max_vms=2)
    api = pal_server.client(key)
    page = browser.pages[0] if browser.pages else browser.new_page()
    refused: list[str] = []
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    try:
        r = api.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, r.text
        vm = r.json()["vmId"]
        page.goto(pal_server.url + f"/runtime/login?next=/runtime/{vm}")
        page.fill("#api_key", key)
        page.click("#signin")
        expect(page.locator("#vm-state")).to_have_text("running")

        # -- open it; a command and its output ------------------------------------------------
        page.click("#terminal-open")
        expect(page.locator("#terminal-status")).to_contain_text("attached to process")
        run(page, "echo hi-$((6*7))")
        wait_screen(page, r"hi-42")

        # -- a full-screen program draws its screen, and gives it back ------------------------
        run(page, "top")
        wait_screen(page, r"load average")
        wait_screen(page, r"PID\s+USER")
        page.locator("#terminal-panel").screenshot(path=str(shots / "terminal-top.png"))
        page.keyboard.press("q")
        run(page, "clear; echo back-$((1+1))")
        wait_screen(page, r"back-2")

        # -- a resize reaches the terminal in the VM --------------------------------------------
        box = page.locator("#terminal")
        before = box.get_attribute("data-size")
        page.set_viewport_size({"width": 760, "height": 900})
        expect(box).not_to_have_attribute("data-size", before or "", timeout=SLOW_MS)
        size = box.get_attribute("data-size")
        assert size and re.fullmatch(r"\d+ \d+", size), size
        run(page, "clear; echo size=$(stty size)=")
        wait_screen(page, re.escape(f"size={size}="))

        # -- a pause detaches; a reattach goes on where it stopped -------------------------------
        run(page, "clear; echo before-pause")
        wait_screen(page, r"before-pause")
        assert api.post(f"/v1/runtime/vms/{vm}/pause", json={"mode": "snapshot"}).status_code == 200
        expect(page.locator("#terminal-status")).to_contain_text("detached", timeout=SLOW_MS)
        assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
        expect(page.locator("#terminal-open")).to_have_text("Reattach")
        page.click("#terminal-open")
        expect(page.locator("#terminal-status")).to_contain_text("attached to process")
        run(page, "echo after-$((2*3))")
        wait_screen(page, r"after-6")

        # -- End hangs the shell up --------------------------------------------------------------
        page.click("#terminal-end")
        expect(page.locator("#terminal-status")).to_contain_text("exited with code")
        assert refused == [], refused
    finally:
        for v in api.get("/v1/runtime/vms").json()["vms"]:
            with contextlib.suppress(httpx.HTTPError):
                api.delete(f"/v1/runtime/vms/{v['vmId']}")
        api.close()
