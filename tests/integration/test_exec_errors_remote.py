"""Issue 24: one exec error mapping. The same failing execs answer the same status and code
from the REST API whether the VM runs on the embedded node (`pal up`: the manager behind
its local RPC socket) or on a remote `pal node` reached over HTTP (a control plane with
one node, as pal_tools/localcluster starts them). The node's own errors keep their status across
the RPC, also in the middle of a stream (pal/manager/rpc.py); the guest's error codes are
mapped once (pal/manager/guest_errors.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pal.config import Settings
from pal.scheduler.node_client import HttpNode
from pal.store import Store
from pal.wire import verbs
from pal.wire.auth import node_token
from pal.wire.models import LivePauseRequest, VmRef
from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import LocalCluster, kill_qemus_under
from tests.conftest import TEST_DATA_DIR, PalServer
from tests.s3server import S3Server

pytestmark = [pytest.mark.vm, pytest.mark.s3]

MISSING_VM = "vm-" + "0" * 24
SSE = {"Accept": "text/event-stream"}
# What each case must answer (the spec's statuses); both nodes must also agree exactly.
EXPECTED = {
    "missing VM": (404, "NOT_FOUND"),
    "missing executable": (400, "EXECUTABLE_NOT_FOUND"),
    "bad cwd": (400, "EXECUTABLE_NOT_FOUND"),  # the harness says ENOENT for a missing cwd
    "bad cwd (SSE)": (200, "EXECUTABLE_NOT_FOUND"),  # a guest's error: an event of the stream
    "live-paused VM": (409, "FAILED_PRECONDITION"),
    "paused VM": (409, "FAILED_PRECONDITION"),
    # Paused on the node behind the scheduler's back: the node's own 409, through its RPC.
    "live-paused on the node": (409, "LIVE_PAUSED"),
}


@pytest.fixture(scope="module")
def remote(
    postgres: LocalPostgres, s3_server: S3Server, tenant_key: str
) -> Iterator[tuple[LocalCluster, str]]:
    """One control-plane replica and one remote `pal node` (sharing the session's images
    and warm templates, which ``tenant_key`` made sure exist); a tenant's key."""
    run = TEST_DATA_DIR / "runs" / f"e-{uuid.uuid4().hex[:6]}"  # short: unix socket paths < 108 bytes
    run.mkdir(parents=True)
    c = LocalCluster(
        base=run,
        database_url=postgres.new_database("execerrors"),
        shared_images=TEST_DATA_DIR,
        s3_endpoint=s3_server.endpoint,
        s3_bucket=f"pal-execerr-{uuid.uuid4().hex[:6]}",
        extra_env={"PAL_HARNESS_READY_TIMEOUT_MS": "60000", "PAL_PRESTART": "0"},  # as conftest
    )
    try:
        c.start_replica("r1")
        c.wait_leader(60)
        c.start_node("n1", memory_mib=2560)
        c.wait_nodes(["n1"], 300)
        store = Store(c.database_url, run_migrations=False)
        try:
            key = store.create_tenant("te", 10)[1]
        finally:
            store.close()
        yield c, key
    finally:
        c.stop_all()
        for p in [*c.replicas.values(), *c.nodes.values()]:
            print(f"--- {p.name}\n{p.log_tail(30)}")
        kill_qemus_under(run)
        shutil.rmtree(run, ignore_errors=True)


def _error(r: httpx.Response) -> tuple[int, str]:
    body = r.json()
    return r.status_code, str(body.get("error", {}).get("code") if "error" in body else body)


def _exec(c: httpx.Client, vm: str, body: dict[str, Any]) -> tuple[int, str]:
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json=body)
    assert r.status_code >= 400, f"{body} ran: {r.text}"
    return _error(r)


def _sse(c: httpx.Client, vm: str, body: dict[str, Any]) -> tuple[int, str]:
    """An SSE exec's status and its error's code (an error the guest reports after the
    stream started comes as an `error` event of a 200 stream)."""
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json=body, headers=SSE)
    if r.status_code >= 400:
        return _error(r)
    frames = [f for f in r.text.split("\n\n") if f.startswith("event: error")]
    assert frames, f"{body} ran: {r.text}"
    return r.status_code, str(json.loads(frames[0].split("data: ", 1)[1])["code"])


def _on_node(node: Callable[[], HttpNode], vm: str, pause: bool) -> None:
    """Live-pause (or resume) the VM on its node directly, the scheduler unaware."""

    async def call() -> None:
        client = node()
        try:
            if pause:
                assert (await client.call(verbs.LIVE_PAUSE, LivePauseRequest(vm_id=vm, by="operator"))).paused
            else:
                assert (await client.call(verbs.LIVE_RESUME, VmRef(vm_id=vm))).resumed
        finally:
            await client.aclose()

    asyncio.run(call())


def error_cases(c: httpx.Client, node: Callable[[], HttpNode]) -> dict[str, tuple[int, str]]:
    """Each failing exec's (status, code), as the REST API answers it; ``node``: a client of
    the RPC of the node the VM runs on."""
    out = {"missing VM": _exec(c, MISSING_VM, {"command": "/bin/true"})}
    r = c.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        out["missing executable"] = _exec(c, vm, {"command": "/no/such/program"})
        out["bad cwd"] = _exec(c, vm, {"command": "/bin/true", "cwd": "/no/such/dir"})
        out["bad cwd (SSE)"] = _sse(c, vm, {"command": "/bin/true", "cwd": "/no/such/dir"})
        _on_node(node, vm, pause=True)
        out["live-paused on the node"] = _exec(c, vm, {"command": "/bin/true"})
        _on_node(node, vm, pause=False)
        r = c.post(f"/v1/runtime/vms/{vm}/pause", json={"mode": "live", "offload": False})
        assert r.status_code == 200, r.text
        out["live-paused VM"] = _exec(c, vm, {"command": "/bin/true"})
        assert c.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
        ok = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/true"})
        assert ok.status_code == 200 and ok.json()["exitCode"] == 0, ok.text
        assert c.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
        out["paused VM"] = _exec(c, vm, {"command": "/bin/true"})
    finally:
        c.delete(f"/v1/runtime/vms/{vm}")
    return out


def test_exec_errors_are_the_same_on_the_embedded_and_a_remote_node(
    pal_server: PalServer, tenant_key: str, remote: tuple[LocalCluster, str]
) -> None:
    cluster, remote_key = remote
    socket = Settings(data_dir=pal_server.data_dir).manager_socket  # the embedded node's RPC
    with pal_server.client(tenant_key) as c:
        embedded = error_cases(c, lambda: HttpNode(socket))
    leader = cluster.wait_leader(30)
    n1, token = cluster.nodes["n1"], node_token(cluster.secret, "n1")
    with httpx.Client(
        base_url=leader.url, headers={"Authorization": f"Bearer {remote_key}"}, timeout=300
    ) as c:
        on_remote = error_cases(c, lambda: HttpNode(url=n1.url, token=token))
    print("embedded:", embedded, "\nremote:  ", on_remote)
    assert on_remote == embedded
    assert embedded == EXPECTED


def test_processes_work_the_same_through_a_remote_node(remote: tuple[LocalCluster, str]) -> None:
    """Issue 22: the process calls and the output stream over the node's RPC on the
    network (the process verbs of pal/wire/verbs.py)."""
    from tests.integration.test_processes import follow, read_all, start, wait

    cluster, remote_key = remote
    leader = cluster.wait_leader(30)
    with httpx.Client(
        base_url=leader.url, headers={"Authorization": f"Bearer {remote_key}"}, timeout=300
    ) as c:
        r = c.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, r.text
        vm = r.json()["vmId"]
        try:
            expected = "".join(f"{i}\n" for i in range(1, 50_001)).encode()
            pid = start(c, vm, "seq 1 50000")
            first, offset, how, _ = follow(c, vm, pid, 0, stop_after=len(expected) // 2)
            assert how == "dropped"
            rest, _end, how, body = follow(c, vm, pid, offset)
            assert how == "exit" and body["exitCode"] == 0 and first + rest == expected
            assert read_all(c, vm, pid)[0] == expected
            cat = start(c, vm, "cat", stdin=True)
            r = c.post(
                f"/v1/runtime/vms/{vm}/processes/{cat}/stdin", params={"eof": "true"}, content=b"\x00\x01"
            )
            assert r.status_code == 200 and r.json() == {"written": 2, "closed": True}, r.text
            assert wait(c, vm, cat)["exitCode"] == 0 and read_all(c, vm, cat)[0] == b"\x00\x01"
            assert c.get(f"/v1/runtime/vms/{vm}/processes/424242").status_code == 404
            assert (
                c.post(f"/v1/runtime/vms/{vm}/processes/{cat}/signal", json={"signal": "INT"}).status_code
                == 409
            )
        finally:
            c.delete(f"/v1/runtime/vms/{vm}")
