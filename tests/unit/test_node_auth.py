"""The node RPC and node heartbeats are never unauthenticated: a per-node token (derived
from the cluster secret) on every call, checked in constant time."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pal.api.app import create_app
from pal.manager.rpc import create_rpc_app
from pal.wire.auth import bearer_matches, node_token
from pal.wire.handlers import Handlers
from tests.fakes import FakeManager, make_env


def test_tokens_are_per_node_and_need_the_secret() -> None:
    a, b = node_token("s3cret", "n1"), node_token("s3cret", "n2")
    assert a != b and a == node_token("s3cret", "n1") and a != node_token("other", "n1")
    assert bearer_matches(f"Bearer {a}", a) and not bearer_matches(f"Bearer {b}", a)
    assert not bearer_matches(None, a) and not bearer_matches(a, a)  # no scheme: refused
    from pal.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        node_token("", "n1")


async def test_the_node_rpc_refuses_calls_without_its_token() -> None:
    app = create_rpc_app(Handlers(), token="tok")  # no handler is ever reached without the token
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://n") as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "tok"}):
            r = await c.get("/heartbeat", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"


async def test_node_heartbeats_need_the_nodes_own_token(tmp_path: Path) -> None:
    env = make_env(tmp_path, cluster_secret="s3cret")
    app = create_app(env.sched, env.store, env.settings)
    node = FakeManager(node_id="n9")
    node.url = "http://127.0.0.1:9"
    body = (await node.heartbeat()).model_dump(by_alias=True, mode="json")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
        wrong = {"Authorization": f"Bearer {node_token('s3cret', 'n1')}"}  # another node's token
        assert (await c.post("/v1/nodes/heartbeat", json=body, headers=wrong)).status_code == 401
        assert env.store.get_node("n9") is None
        ok = {"Authorization": f"Bearer {node_token('s3cret', 'n9')}"}
        r = await c.post("/v1/nodes/heartbeat", json=body, headers=ok)
        assert r.status_code == 200 and r.json()["state"] == "active"
        assert env.store.get_node("n9").url == "http://127.0.0.1:9"  # type: ignore[union-attr]
        assert (await c.get("/v1/nodes")).status_code == 401  # loopback is not the operator
        assert (await c.get("/v1/nodes", headers=ok)).status_code == 403  # nor is a node
    env.settings.admin_token = "adm"
    remote = httpx.ASGITransport(app=app, client=("192.0.2.7", 40000))
    async with httpx.AsyncClient(transport=remote, base_url="http://localhost") as c:
        assert (await c.get("/v1/nodes")).status_code == 401
        assert (await c.get("/v1/nodes", headers={"Authorization": "Bearer x"})).status_code == 403
        listed = await c.get("/v1/nodes", headers={"Authorization": "Bearer adm"})
        assert listed.status_code == 200 and [n["nodeId"] for n in listed.json()["nodes"]] == ["n9"]


async def test_a_control_plane_without_a_cluster_secret_takes_no_nodes(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    app = create_app(env.sched, env.store, env.settings)
    node = FakeManager(node_id="n9")
    node.url = "http://127.0.0.1:9"
    body = (await node.heartbeat()).model_dump(by_alias=True, mode="json")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
        r = await c.post("/v1/nodes/heartbeat", json=body, headers={"Authorization": "Bearer x"})
    assert r.status_code == 403 and "PAL_CLUSTER_SECRET" in r.json()["error"]["message"]
