"""Pal's idle suspend through the unmodified E2B Python SDK: a server of its own with a short
PAL_E2B_IDLE_TIMEOUT suspends an idle E2B sandbox (Pal's snapshot pause, ``pausedBy: idle``),
E2B still sees it running, and the SDK's next call wakes it: ``commands.run`` and
``files.read`` answer as if it never slept, with the files and the output it had."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, SandboxState

from tests.conftest import scratch_run_dir, start_server, stop_server
from tests.e2b.conftest import RealE2b, e2b_environ, e2b_key

pytestmark = pytest.mark.vm

IDLE_S = 2
DEADLINE_S = 300  # a hang guard, not a speed bound: a loaded 2-core machine suspends late


@pytest.fixture(scope="module")
def idle_e2b(warm_template: None) -> Iterator[tuple[RealE2b, httpx.Client]]:
    """A `pal up` whose E2B sandboxes suspend after IDLE_S idle seconds; its tenant's E2B
    environment and a Pal API client of the same tenant (to see the VM's own state)."""
    with scratch_run_dir("e2bidle") as run_dir:
        server = start_server(run_dir, extra_env={"PAL_E2B_IDLE_TIMEOUT": str(IDLE_S)})
        try:
            key = server.tenant("e2b-idle", max_vms=2)
            with server.client(key, timeout=120) as api:
                yield RealE2b(server, e2b_key(server, "e2b-idle"), ""), api
        finally:
            stop_server(server)


def suspended(api: httpx.Client, vm: str) -> dict[str, object]:
    """Poll until Pal's idle suspend paused ``vm``; its record then."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = api.get(f"/v1/runtime/vms/{vm}").json()
        if got["state"] == "paused":
            return dict(got)
        time.sleep(0.25)
    raise AssertionError(f"{vm} was never suspended: {api.get(f'/v1/runtime/vms/{vm}').json()}")


def test_an_idle_suspended_sandbox_wakes_on_the_next_sdk_call(idle_e2b: tuple[RealE2b, httpx.Client]) -> None:
    real, api = idle_e2b
    with e2b_environ(real):
        sbx = Sandbox.create(timeout=900)
        try:
            sbx.files.write("/home/user/kept.txt", "written before the sleep\n")
            background = sbx.commands.run("echo before; sleep 0.2; echo after", background=True)
            assert background.wait().stdout == "before\nafter\n"

            first = suspended(api, sbx.sandbox_id)
            assert first["pausedBy"] == "idle", first
            assert sbx.get_info().state == SandboxState.RUNNING  # E2B's view: it never stopped
            woke = sbx.commands.run("echo woke; cat /home/user/kept.txt; whoami")
            assert woke.stdout == "woke\nwritten before the sleep\nuser\n"
            assert api.get(f"/v1/runtime/vms/{sbx.sandbox_id}").json()["state"] == "running"

            assert suspended(api, sbx.sandbox_id)["pausedBy"] == "idle"
            assert sbx.files.read("/home/user/kept.txt") == "written before the sleep\n"
            assert api.get(f"/v1/runtime/vms/{sbx.sandbox_id}").json()["state"] == "running"
        finally:
            sbx.kill()
