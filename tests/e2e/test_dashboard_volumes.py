"""The dashboard's Volumes page in a real browser (Debian's chromium driven by Playwright)
against the real API and dashboard served over loopback HTTP, with the node's real volume
code (tests/fakes.py): a volume needs no VM, so none is booted. Sign in, go to Volumes from
the header, create a volume (a taken name answered in words), open it, upload a file into
a folder, view and download it, remove it, delete the volume."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import BrowserContext, expect, sync_playwright

from pal.api.app import create_app
from pal.dashboard.app import install_dashboard
from tests.apienv import serve
from tests.e2e.test_dashboard import CHROMIUM_ARGS, chromium_path
from tests.fakes import make_env


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[BrowserContext]:
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
            accept_downloads=True,
        )
        ctx.set_default_timeout(60_000)
        expect.set_options(timeout=60_000)
        try:
            yield ctx
        finally:
            ctx.close()


def test_the_volumes_page_in_a_browser(tmp_path: Path, browser: BrowserContext) -> None:
    e = make_env(tmp_path / "env", max_vms=1)
    _, key = e.store.create_tenant("vol-user", 1)
    app = create_app(e.sched, e.store, e.settings)
    install_dashboard(app, e.sched, e.store, e.settings)
    local = tmp_path / "notes.txt"
    local.write_text("kept in a volume\n")
    page = browser.pages[0] if browser.pages else browser.new_page()
    page.on("dialog", lambda d: d.accept())  # the confirmations of remove and delete
    with serve(app) as url:
        page.goto(url + "/runtime/volumes")
        expect(page).to_have_url(re.compile(r"/runtime/login"))
        page.fill("#api_key", key)
        page.click("#signin")
        expect(page).to_have_url(url + "/runtime/volumes")
        expect(page.locator("#volume-rows")).to_contain_text("No volumes yet")

        page.fill("#volume-name", "datasets")
        page.fill("#volume-size", "64")
        page.click("#create-volume-btn")
        expect(page.locator("#create-volume-msg .msg.ok")).to_contain_text("Created volume datasets")
        row = page.locator("#volume-rows tr", has_text="datasets")
        expect(row).to_contain_text("64 MiB")  # the list refreshed on volumesChanged
        page.click("#create-volume-btn")  # the same name again
        expect(page.locator("#create-volume-msg .msg.err")).to_contain_text("(409)")

        row.locator("a.vm-id").click()
        expect(page.locator("h1")).to_contain_text("datasets")
        expect(page.locator("#files")).to_contain_text("Empty folder")
        page.set_input_files("#upload-file", str(local))
        page.click("#upload-btn")
        expect(page.locator("#files-msg .msg.ok")).to_contain_text("Uploaded notes.txt")
        entry = page.locator('#files li[data-name="notes.txt"]')
        expect(entry).to_contain_text("17 B")  # the listing refreshed on filesChanged
        entry.locator("a.view").click()
        expect(page.locator("#file-text")).to_have_text("kept in a volume\n")
        shots = Path(os.environ.get("PAL_DASHBOARD_SCREENSHOTS") or tmp_path / "shots")
        shots.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shots / "dashboard-volume.png"), full_page=True)
        with page.expect_download() as got:
            entry.locator("a.download").click()
        assert Path(got.value.path()).read_text() == "kept in a volume\n"
        entry.locator("button.remove").click()
        expect(page.locator("#files-msg .msg.ok")).to_contain_text("Removed notes.txt")
        expect(page.locator("#files")).to_contain_text("Empty folder")

        page.click("#nav-volumes")
        page.locator("#volume-rows tr", has_text="datasets").locator("button.danger").click()
        expect(page.locator("#volumes-msg .msg.ok")).to_contain_text("Deleted volume datasets")
        expect(page.locator("#volume-rows")).to_contain_text("No volumes yet")
        page.click("#nav-sandboxes")
        expect(page).to_have_url(url + "/runtime")
