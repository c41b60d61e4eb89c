"""The VM page's code panel in a real browser (Debian's chromium, Playwright) against a real
`pal up` and a VM of the code-interpreter image: a cell keeps its state for the next one,
a matplotlib figure shows as an image of the right size, a DataFrame as an HTML table (in
a sandboxed frame), an exception as its traceback."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import BrowserContext, expect

from tests.conftest import PalServer
from tests.e2e.test_dashboard import SLOW_MS, browser, shots  # noqa: F401 (fixtures)
from tests.integration.test_code import PLOT, SPEC, code_image  # noqa: F401 (fixture)

pytestmark = pytest.mark.vm


def test_a_cell_and_its_results_in_the_dashboard(
    pal_server: PalServer,
    code_image: str,  # noqa: F811
    browser: BrowserContext,  # noqa: F811
    shots: Path,  # noqa: F811
) -> None:
    key = pal_server.tenant("e2e-code", max_vms=2)
    api = pal_server.client(key)
    page = browser.pages[0] if browser.pages else browser.new_page()
    try:
        vm = api.post("/v1/runtime/schedule", json=SPEC).json()["vmId"]  # as the docs say: 512 MiB
        page.goto(pal_server.url + "/runtime")
        page.fill("#api_key", key)
        page.click("#signin")
        page.goto(f"{pal_server.url}/runtime/{vm}")
        out = page.locator("#code-out")

        def cell(code: str) -> None:
            page.fill("#code-cell", code)
            page.click("#code-run")
            expect(page.locator("#code-run")).to_be_enabled(timeout=SLOW_MS)

        cell("x = 41")
        expect(out.locator(".code-result")).to_be_visible(timeout=SLOW_MS)
        cell("x + 1")
        expect(out.locator(".code-text")).to_have_text("42", timeout=SLOW_MS)

        cell(PLOT)
        img = out.locator("img.code-png")
        expect(img).to_be_visible(timeout=SLOW_MS)
        assert img.evaluate("el => [el.naturalWidth, el.naturalHeight]") == [200, 150]
        page.screenshot(path=str(shots / "code-panel.png"), full_page=True)

        cell("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
        frame = out.locator("iframe.code-html")
        expect(frame).to_be_visible(timeout=SLOW_MS)
        assert frame.get_attribute("sandbox") == ""  # no scripts, no same origin
        expect(page.frame_locator("iframe.code-html").locator("table")).to_be_visible()

        cell("1 / 0")
        expect(out.locator(".code-error")).to_contain_text("ZeroDivisionError", timeout=SLOW_MS)
    finally:
        for v in api.get("/v1/runtime/vms").json()["vms"]:
            with contextlib.suppress(httpx.HTTPError):
                api.delete(f"/v1/runtime/vms/{v['vmId']}")
        api.close()
