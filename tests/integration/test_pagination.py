"""Issue 25 item 3: cursor pagination of the VM list, a VM's events and snapshots, and the
images: pages of `limit` items cover the list once, in order, whatever the page size; a
cursor that this list did not hand out is a 400."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from pal.api.pagination import MAX_PAGE_LIMIT, encode

pytestmark = pytest.mark.vm


def walk(api: httpx.Client, path: str, field: str, limit: int, **params: str) -> list[Any]:
    """Every item of the list, ``limit`` per request, checking each page's size."""
    items: list[Any] = []
    query: dict[str, Any] = {**params, "limit": limit}
    while True:
        r = api.get(path, params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page[field]) <= limit, page
        items += page[field]
        if "nextCursor" not in page:
            return items
        assert len(page[field]) == limit, page  # only the last page may be short
        query["cursor"] = page["nextCursor"]


def test_pages_cover_every_list_once_in_order(api: httpx.Client) -> None:
    tag = uuid.uuid4().hex[:12]
    vms = [
        api.post("/v1/runtime/schedule", json={"metadata": {"page": tag}}).json()["vmId"] for _ in range(3)
    ]
    try:
        for limit in (1, 2, 3):
            got = walk(api, "/v1/runtime/vms", "vms", limit, **{"metadata.page": tag})
            assert [v["vmId"] for v in got] == vms, limit
        # the whole tenant's list: the same VMs as one page, none twice
        whole = api.get("/v1/runtime/vms").json()
        assert "nextCursor" not in whole
        paged = [v["vmId"] for v in walk(api, "/v1/runtime/vms", "vms", 2)]
        assert paged == [v["vmId"] for v in whole["vms"]] and len(set(paged)) == len(paged)
        assert set(vms) <= set(paged)
        # events: pause and resume make a few more, then page them one by one
        assert api.post(f"/v1/runtime/vms/{vms[0]}/pause").status_code == 200
        assert api.post(f"/v1/runtime/vms/{vms[0]}/resume").status_code == 200
        events = api.get(f"/v1/runtime/vms/{vms[0]}/events").json()["events"]
        assert len(events) >= 4
        assert walk(api, f"/v1/runtime/vms/{vms[0]}/events", "events", 1) == events
        snaps = api.get(f"/v1/runtime/vms/{vms[0]}/snapshots").json()["snapshots"]
        assert snaps  # the pause's
        assert walk(api, f"/v1/runtime/vms/{vms[0]}/snapshots", "snapshots", 1) == snaps
        images = api.get("/v1/images").json()["images"]
        assert images and walk(api, "/v1/images", "images", 1) == images
    finally:
        for vm in vms:
            api.delete(f"/v1/runtime/vms/{vm}")


@pytest.mark.parametrize("path", ["/v1/runtime/vms", "/v1/images", "/v1/runtime/vms/{vm}/events"])
def test_a_cursor_this_list_did_not_hand_out_is_a_400(api: httpx.Client, path: str) -> None:
    vm = api.post("/v1/runtime/schedule", json={}).json()["vmId"] if "{vm}" in path else ""
    try:
        url = path.format(vm=vm)
        # garbage, base64 of `{}`, and a well-formed cursor of another list
        for cursor in ("not-a-cursor", "e30", encode("snapshots", ["", "snap-1"])):
            r = api.get(url, params={"cursor": cursor})
            assert r.status_code == 400, (cursor, r.text)
            err = r.json()["error"]
            assert err["code"] == "INVALID_ARGUMENT" and "cursor" in err["message"], err
        for limit in (0, MAX_PAGE_LIMIT + 1):
            r = api.get(url, params={"limit": limit})
            assert r.status_code == 400, r.text
    finally:
        if vm:
            api.delete(f"/v1/runtime/vms/{vm}")
