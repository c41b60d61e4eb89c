"""Issue 9 item 1: the runtime manager's boundary. Ids that become paths are validated
before any work (400), the RPC socket is root-only by its modes and by its peer's
credentials, and the tenant of a restore comes from the VM's row, never from a caller."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pal.config import Settings
from pal.errors import InvalidRequest
from pal.ids import validate_id
from pal.manager import rpc_socket
from pal.manager.rpc import create_rpc_app
from pal.manager.runtime import NodeRuntime
from pal.spec import AgentSpec
from pal.vmm.accel import AccelInfo
from pal.wire import verbs
from pal.wire.handlers import Handlers
from pal.wire.models import SnapshotAt, SnapshotDeleted, Stopped, StopVm
from tests.fakes import make_env

NOBODY = 65534
BAD_IDS = ["..", ".hidden", "a/b", "x" * 129, "", "a b", "a\x00b"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_one_id_rule(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        validate_id(bad, "vm_id")
    assert validate_id("vm-1a2B_c.d", "vm_id") == "vm-1a2B_c.d"


class _Recorder:
    """Stands in for a node's handlers: records what got through the RPC layer."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def stop(self, req: StopVm) -> Stopped:
        self.calls.append(("stop", req.vm_id))
        return Stopped(vm_id=req.vm_id, stopped=True)

    async def delete_snapshot(self, req: SnapshotAt) -> SnapshotDeleted:
        self.calls.append(("delete_snapshot", (req.agent_version_id, req.vm_id, req.snapshot_id)))
        return SnapshotDeleted(deleted=True)

    async def spawn(self, req: Any) -> Any:
        self.calls.append(("spawn", req))
        raise InvalidRequest("recorded")

    def handlers(self) -> Handlers:
        h = Handlers()
        h.on(verbs.STOP, self.stop)
        h.on(verbs.DELETE_SNAPSHOT, self.delete_snapshot)
        h.on(verbs.SPAWN, self.spawn)
        return h


@pytest.fixture
def rpc() -> tuple[TestClient, _Recorder]:
    rec = _Recorder()
    return TestClient(create_rpc_app(rec.handlers())), rec


@pytest.mark.parametrize("bad", ["..", ".x", "a%2Fb", "%2E%2E"])
def test_bad_ids_in_paths_are_400_before_any_work(rpc: tuple[TestClient, _Recorder], bad: str) -> None:
    client, rec = rpc
    for method, url in (
        ("DELETE", f"/vms/{bad}"),
        ("DELETE", f"/snapshots/av/{bad}/snap"),
        ("DELETE", f"/snapshots/{bad}/vm/snap"),
        ("GET", f"/snapshots/av/vm/{bad}"),
    ):
        r = client.request(method, url)
        assert r.status_code in (400, 404), (url, r.status_code)  # a '/' never matches a route
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert rec.calls == []
    assert client.delete("/vms/vm-ok").status_code == 200 and rec.calls == [("stop", "vm-ok")]


def test_bad_ids_in_bodies_are_400(rpc: tuple[TestClient, _Recorder]) -> None:
    client, rec = rpc
    base = {"vmId": "vm-1", "tenantId": "t-1", "image": "default", "vcpus": 1, "memoryMib": 256}
    base |= {"diskMib": 2048, "token": "x"}
    restore = {"snapshotId": "s", "agentVersionId": "av", "sourceVmId": "vm-0", "tenantId": "t-1"}
    for bad in (
        {"vmId": "../../etc"},
        {"image": "../x"},
        {"tenantId": "../t"},
        {"restore": {**restore, "snapshotId": ".."}},
        {"restore": {**restore, "sourceVmId": "a/b"}},
        {"restore": {**restore, "agentVersionId": ".staging"}},
    ):
        r = client.post("/vms", json={**base, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert rec.calls == []
    r = client.post("/vms", json={**base, "restore": restore})
    assert r.status_code == 400 and r.json()["error"]["message"] == "recorded"  # reached the runtime


def test_runtime_makes_no_path_from_a_bad_vm_id(tmp_path: Path) -> None:
    rt = NodeRuntime(Settings(data_dir=tmp_path), store=None, accel=AccelInfo("tcg", "test"))  # type: ignore[arg-type]
    (tmp_path / "victim").mkdir()
    with pytest.raises(InvalidRequest):
        asyncio.run(rt.stopper.stop(".."))
    with pytest.raises(InvalidRequest):
        asyncio.run(rt.stopper.stop("../victim"))
    assert (tmp_path / "victim").is_dir()


def _as_nobody(code: str, *args: str) -> str:
    out = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            code,
            *args,
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return out.stdout.strip()


CLIENT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"connect": e.errno})); sys.exit()
s.settimeout(20)
try:
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: m\\r\\n\\r\\n")
    data = s.recv(100)
except OSError as e:
    data = str(e).encode()
print(json.dumps({"connect": 0, "reply": data.decode(errors="replace")}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to be a different uid than `nobody`")
async def test_rpc_socket_is_root_only_by_modes_and_by_peer() -> None:
    base = Path(tempfile.mkdtemp(prefix="pal-rpc-"))  # pytest's tmp_path sits under 0700 dirs
    path = base / "run" / "manager.sock"
    sock = rpc_socket.bind(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.parent.stat().st_uid == 0
    app = FastAPI()

    @app.get("/")
    async def hello() -> dict[str, bool]:
        return {"ok": True}

    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", http=rpc_socket.PeerCheckedProtocol)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(path))) as c:
            assert (await c.get("http://m/")).json() == {"ok": True}, "root gets through"
        base.chmod(0o755)
        # By the modes: another user cannot even connect.
        res = json.loads(await asyncio.to_thread(_as_nobody, CLIENT, str(path)))
        assert res["connect"] != 0
        # By the peer check: even through an open door, the connection is dropped unanswered.
        path.parent.chmod(0o755)
        path.chmod(0o666)
        res = json.loads(await asyncio.to_thread(_as_nobody, CLIENT, str(path)))
        assert res["connect"] == 0 and "HTTP" not in res["reply"], res  # EOF or reset, no answer
    finally:
        server.should_exit = True
        await task
        shutil.rmtree(base)


async def test_restores_name_the_tenant_of_the_vms_row(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    view, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    vm_id = view.vm_id
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    await env.sched.forking.fork(env.tenant_id, vm_id, 2)
    restores = [r.restore for r in env.manager.spawn_requests if r.restore is not None]
    assert len(restores) == 3
    assert {r.tenant_id for r in restores} == {env.tenant_id}
    assert {req.tenant_id for _, req in env.manager.snapshot_requests} == {env.tenant_id}
