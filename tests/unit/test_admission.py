"""Issue 9 item 5: node admission on free disk and memory. A spawn or snapshot that would not
fit is refused with 507 before any work; a refused pause leaves the VM running."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pal.errors import InsufficientStorage
from pal.manager import admission
from tests.apienv import make_api


def test_disk_and_memory_checks_use_the_real_file_system_and_host(tmp_path: Path) -> None:
    free = admission.disk_free_mib(tmp_path)
    admission.check_disk(tmp_path, 1, "a small VM")  # this host has room for 1 MiB
    with pytest.raises(InsufficientStorage, match=r"needs about \d+ MiB plus 1024 MiB kept free") as exc:
        admission.check_disk(tmp_path, free, "a VM as big as the free space")
    assert exc.value.status == 507
    avail = admission.memory_available_mib()
    assert avail is not None and avail > 0
    admission.check_memory(1, "a tiny VM")
    with pytest.raises(InsufficientStorage, match="not enough memory"):
        admission.check_memory(avail * 4 + 1024, "a VM bigger than the host")


async def test_a_pause_refused_for_disk_is_507_and_the_vm_keeps_running(tmp_path: Path) -> None:
    api = make_api(tmp_path)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api.app),
        base_url="http://localhost",
        headers={"Authorization": f"Bearer {api.key_a}"},
    ) as c:
        vm = (await c.post("/v1/runtime/schedule", json={})).json()["vmId"]
        api.manager.fail("snapshot", InsufficientStorage("not enough disk on this node for a snapshot"))
        r = await c.post(f"/v1/runtime/vms/{vm}/pause")
        assert r.status_code == 507 and "still running" in r.json()["error"]["message"], r.text
        assert (await c.get(f"/v1/runtime/vms/{vm}")).json()["state"] == "running"
        assert (await c.post(f"/v1/runtime/vms/{vm}/pause")).status_code == 200  # room again
