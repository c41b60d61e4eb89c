"""Issue 28: a buffered exec that never ends is killed at the server's default timeout
(PAL_EXEC_DEFAULT_TIMEOUT), set low for this test's own `pal up`; a request's own
``timeoutSecs`` wins over the default. Real VMs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import scratch_run_dir, start_server, stop_server, wait_template

pytestmark = pytest.mark.vm

DEFAULT_S = 3  # the test server's PAL_EXEC_DEFAULT_TIMEOUT


@pytest.fixture(scope="module")
def api() -> Iterator[httpx.Client]:
    with scratch_run_dir("exec-default-timeout") as run_dir:
        server = start_server(run_dir, {"PAL_EXEC_DEFAULT_TIMEOUT": str(DEFAULT_S)})
        try:
            key = server.tenant("exec-timeout", max_vms=2)
            wait_template(server, key)
            with server.client(key) as c:
                yield c
        finally:
            stop_server(server)


@pytest.fixture
def vm(api: httpx.Client) -> Iterator[str]:
    r = api.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    vm_id = r.json()["vmId"]
    try:
        yield vm_id
    finally:
        api.delete(f"/v1/runtime/vms/{vm_id}")


def test_a_command_blocked_on_a_fifo_ends_at_the_default_timeout(api: httpx.Client, vm: str) -> None:
    # No timeoutSecs: before the default, this request stayed open until the VM was deleted
    # (the client's own hang guard below would fail the test instead).
    body = {"command": "/bin/sh", "argv": ["-c", "mkfifo /tmp/f && echo waiting && cat /tmp/f"]}
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["timedOut"] is True and out["exitCode"] == 124, out
    assert out["stdout"] == "waiting\n", out  # the output so far comes back with it

    # The VM is fine afterwards, and the fifo's reader is gone.
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", "echo ok"]})
    assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text


def test_the_requests_own_timeout_wins_over_the_default(api: httpx.Client, vm: str) -> None:
    # Runs past the default; its own, longer timeoutSecs lets it finish.
    body = {"command": "/bin/sh", "argv": ["-c", f"sleep {DEFAULT_S + 2}; echo done"], "timeoutSecs": 120}
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["exitCode"] == 0 and r.json()["stdout"] == "done\n", r.json()
    assert not r.json().get("timedOut"), r.json()

    # A shorter one applies too.
    body = {"command": "/bin/sh", "argv": ["-c", "sleep 60"], "timeoutSecs": 1}
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=body, timeout=300)
    assert r.json()["timedOut"] is True, r.json()


def test_a_streamed_exec_has_no_default(api: httpx.Client, vm: str) -> None:
    """SSE readers see the output and can stop it: the default is for buffered exec only."""
    body = {"command": "/bin/sh", "argv": ["-c", f"sleep {DEFAULT_S + 2}; echo streamed"]}
    with api.stream(
        "POST", f"/v1/runtime/vms/{vm}/exec", json=body, headers={"Accept": "text/event-stream"}, timeout=300
    ) as r:
        text = "".join(r.iter_text())
    assert "event: exit" in text and "streamed" in text and "timedOut" not in text, text
