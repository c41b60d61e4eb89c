"""The code interpreter (issue 26; docs/agents.md "Code interpreter") on real VMs of the
code-interpreter image, built once per test data dir (`pal image build code-interpreter`,
reused while its recipe and Pal's guest files are unchanged).

One VM carries the cell semantics (state, PNG, HTML, tracebacks, timeout, contexts, SSE),
then a pause and resume and a fork; another the idle suspend and a server restart, on a
server of its own."""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    TEST_DATA_DIR,
    PalServer,
    pal_cli,
    scratch_run_dir,
    start_server,
    stop_server,
)

IMAGE = "code-interpreter"
# 512 MiB: an ipykernel with numpy, pandas and matplotlib loaded, beside the driver.
SPEC = {"image": IMAGE, "limits": {"memoryMib": 512}}
# A 4x3 inch figure at 50 dpi: a 200x150 PNG (uncropped: the inline backend's default
# bbox_inches="tight" trims the margins; `%config InlineBackend.print_figure_kwargs` would
# unregister the PNG formatter in Debian's matplotlib-inline 0.1.6).
PLOT = (
    "from matplotlib_inline.backend_inline import set_matplotlib_formats\n"
    "set_matplotlib_formats('png', bbox_inches=None)\n"
    "import matplotlib.pyplot as plt\nplt.figure(figsize=(4, 3), dpi=50)\nplt.plot([1, 3])\nplt.show()"
)


SSE = {"Accept": "text/event-stream"}
# A kernel sending error events without end: 300 tracebacks of 10,000 characters, 3 MB.
ERROR_FLOOD = (
    "ip = get_ipython()\n"
    "for _ in range(300):\n"
    "    try:\n"
    "        raise ZeroDivisionError('x' * 10_000)\n"
    "    except ZeroDivisionError:\n"
    "        ip.showtraceback()"
)
FLOOD_BYTES = 300 * 10_000
# The bound (1 MiB of text and errors + the notes' reserve), as SSE JSON: escaping and event
# framing at most double it.
WIRE_BOUND = 2 * (1024 * 1024 + 4096) + 64 * 1024
RSS_BOUND_MIB = 64  # the server's growth while it folds and streams the flood
# A display result nested 200 levels deep (past MAX_RESULT_JSON_DEPTH; one nested past the
# host's parser, the finding's 100,000, is tests/unit/test_code_host_bounds.py's).
DEEP_RESULT = (
    "from IPython.display import display\n"
    "v = 0\n"
    "for _ in range(200):\n"
    "    v = [v]\n"
    "display({'text/plain': 'deep', 'application/json': v}, raw=True)"
)


def server_rss_mib(server: PalServer) -> float:
    """The server process's resident memory (its QEMUs are the guests')."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="session")
def code_image() -> str:
    out = pal_cli("image", "build", IMAGE, "--data-dir", str(TEST_DATA_DIR), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return IMAGE


def run(c: httpx.Client, vm: str, code: str, **fields: Any) -> dict[str, Any]:
    r = c.post(f"/v1/runtime/vms/{vm}/code", json={"code": code, **fields})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def wait_state(c: httpx.Client, vm: str, state: str) -> None:
    for _ in range(2400):  # a hang guard (0.25 s polls), not a speed bound
        if c.get(f"/v1/runtime/vms/{vm}").json()["state"] == state:
            return
        time.sleep(0.25)
    raise AssertionError(f"VM {vm} never became {state}")


@pytest.fixture
def code_vm(api: httpx.Client, code_image: str) -> Iterator[str]:
    r = api.post("/v1/runtime/schedule", json=SPEC)
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        yield vm
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_cells_keep_state_and_return_rich_results(
    pal_server: PalServer, api: httpx.Client, code_vm: str
) -> None:
    vm = code_vm
    first = run(api, vm, "x = 41")
    assert first["contextId"] == "default-python" and first["error"] is None and first["text"] is None
    out = run(api, vm, "print('hi'); x + 1")
    assert out["text"] == "42" and out["stdout"] == "hi\n"
    assert out["executionCount"] == first["executionCount"] + 1
    assert out["results"] == [{"text/plain": "42", "isMainResult": True}]

    fig = run(api, vm, PLOT)
    (png,) = [r for r in fig["results"] if "image/png" in r]
    assert png_size(base64.b64decode(png["image/png"])) == (200, 150)
    assert png["isMainResult"] is False

    df = run(api, vm, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['u', 'v']})")
    assert "<table" in df["results"][0]["text/html"] and df["results"][0]["isMainResult"] is True

    err = run(api, vm, "def f():\n    return 1 / 0\nf()")
    assert err["error"]["name"] == "ZeroDivisionError" and err["error"]["value"] == "division by zero"
    assert any("1 / 0" in line for line in err["error"]["traceback"])
    assert not any("\x1b[" in line for line in err["error"]["traceback"])

    loop = run(api, vm, "while True:\n    pass", timeoutSecs=2)
    assert loop["timedOut"] is True and loop["error"]["name"] == "KeyboardInterrupt"
    assert run(api, vm, "x + 1")["text"] == "42"  # the context survived the interrupt

    # Two contexts are two kernels.
    r = api.post(f"/v1/runtime/vms/{vm}/code/contexts", json={"language": "python", "env": {"WHO": "b"}})
    assert r.status_code == 201, r.text
    other = r.json()["contextId"]
    isolated = run(api, vm, "import os\n('x' in globals(), os.environ['WHO'])", contextId=other)
    assert isolated["text"] == "(False, 'b')"
    listed = api.get(f"/v1/runtime/vms/{vm}/code/contexts").json()["contexts"]
    assert {c["contextId"] for c in listed} == {"default-python", other}
    assert api.delete(f"/v1/runtime/vms/{vm}/code/contexts/{other}").status_code == 200
    gone = api.post(f"/v1/runtime/vms/{vm}/code", json={"code": "1", "contextId": other})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "CONTEXT_NOT_FOUND"
    bad = api.post(f"/v1/runtime/vms/{vm}/code", json={"code": "1", "language": "cobol"})
    assert bad.status_code == 400

    # bash keeps its shell state too.
    run(api, vm, "cd /tmp && Y=7", language="bash")
    assert run(api, vm, "echo $Y $PWD", language="bash")["stdout"] == "7 /tmp\n"

    # SSE: the same cell as events.
    events = sse(api, vm, {"code": "print('a'); x"})
    assert [e for e, _ in events] == ["stdout", "result", "end"]
    assert events[1][1]["data"]["text/plain"] == "41" and events[2][1]["contextId"] == "default-python"

    # A pause and a resume keep the kernel.
    assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
    assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
    assert run(api, vm, "x + 1")["text"] == "42"

    # A fork's children each continue from the same kernel state, then diverge.
    r = api.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 2})
    assert r.status_code == 200, r.text
    children = [ch["vmId"] for ch in r.json()["forks"]]
    try:
        for i, child in enumerate(children):
            assert run(api, child, f"x += {i + 1}\nx")["text"] == str(42 + i)
        assert [run(api, ch, "x")["text"] for ch in children] == ["42", "43"]
        assert run(api, vm, "x")["text"] == "41"
    finally:
        for child in children:
            api.delete(f"/v1/runtime/vms/{child}")

    # Error events count in the cell's bound (the finding: a cell printing tracebacks in a
    # loop grew the server by 230 MiB and streamed 260 MB): buffered, the answer holds the
    # bound's worth and says it was cut; streamed, the wire carries no more than the bound.
    rss0 = server_rss_mib(pal_server)
    flood = run(api, vm, ERROR_FLOOD)
    assert flood["error"] is not None and "output and errors cut" in flood["stderr"], flood["stderr"][-300:]
    wire = 0
    with api.stream("POST", f"/v1/runtime/vms/{vm}/code", json={"code": ERROR_FLOOD}, headers=SSE) as r:
        assert r.status_code == 200
        wire = sum(len(chunk) for chunk in r.iter_raw())
    assert FLOOD_BYTES > WIRE_BOUND and wire < WIRE_BOUND, wire
    assert server_rss_mib(pal_server) - rss0 < RSS_BOUND_MIB
    # A display result nested too deep to carry loses that type (its others stay), and the
    # context runs on (the finding: a RecursionError on the host, 503, the context left busy).
    deep = run(api, vm, DEEP_RESULT)
    assert deep["results"] == [{"text/plain": "deep", "isMainResult": False}], deep["results"]
    assert run(api, vm, "x")["text"] == "41"


def sse(c: httpx.Client, vm: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    got: list[tuple[str, dict[str, Any]]] = []
    headers = {"Accept": "text/event-stream"}
    with c.stream("POST", f"/v1/runtime/vms/{vm}/code", json=body, headers=headers) as r:
        assert r.status_code == 200
        event = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                got.append((event, json.loads(line[6:])))
    return got


def test_python_needs_the_code_interpreter_image(api: httpx.Client, vm: str) -> None:
    r = api.post(f"/v1/runtime/vms/{vm}/code", json={"code": "1 + 1"})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "KERNEL_UNAVAILABLE" and "code-interpreter" in error["message"]
    # bash contexts need only bash: the default image has one.
    assert run(api, vm, "echo $((6 * 7))", language="bash")["stdout"] == "42\n"


def test_a_kernel_survives_idle_suspend_and_a_server_restart(code_image: str) -> None:
    with scratch_run_dir("code") as run_dir:
        server = start_server(run_dir)
        try:
            key = server.tenant("code", max_vms=4)
            vm = _idle_round(server, key)
        finally:
            stop_server(server)
        server = start_server(run_dir)
        try:
            with server.client(key) as c:
                assert run(c, vm, "x + 1")["text"] == "42"
                c.delete(f"/v1/runtime/vms/{vm}")
        finally:
            stop_server(server)


def _idle_round(server: PalServer, key: str) -> str:
    with server.client(key) as c:
        r = c.post("/v1/runtime/schedule", json={**SPEC, "idleTimeoutSecs": 5})
        assert r.status_code == 200, (r.text, server.log_tail())
        vm = r.json()["vmId"]
        run(c, vm, "x = 41")
        wait_state(c, vm, "paused")  # an idle kernel lets its VM be suspended
        assert run(c, vm, "x + 1")["text"] == "42"  # the cell wakes it
        return str(vm)
