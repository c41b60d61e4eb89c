"""Many simulated nodes (simnode.py) in one process, for `pal bench control-plane`.

Each node is its own RPC app (the real ``create_rpc_app``, its own token), mounted at
``/n/<node id>`` of one HTTP server; the URL it reports is that prefix, so the control
plane's client reaches it as it reaches any node (``HttpNode(url=...)``). Each node
pushes its heartbeat with the real ``pal.node.Heartbeats`` (one shared HTTP client),
the first ones spread over one interval.

Run: ``python -m pal_tools.bench.simnodes --seed SEED.json --port P --server URL...`` with
``PAL_CLUSTER_SECRET`` in the environment (the nodes' tokens derive from it). The seed
names the nodes and what each already runs and holds (the benchmark's fill). ``GET
/_sim`` answers the nodes' call counts and live VMs (loopback, no token: bench only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import tempfile
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from pal.config import Settings
from pal.manager.rpc import create_rpc_app
from pal.node import Heartbeats
from pal.server import _Server, http_config
from pal.wire.auth import node_token
from pal_tools.bench.simnode import SimNode, SimNodeConfig, SimTimes

log = logging.getLogger("pal_tools.bench.simnodes")
PREFIX = "/n/"


def node_url(base: str, node_id: str) -> str:
    return f"{base.rstrip('/')}{PREFIX}{node_id}"


def build(seed: list[dict[str, Any]], base_url: str, times: SimTimes) -> list[SimNode]:
    nodes = []
    for entry in seed:
        node_id = entry["nodeId"]
        node = SimNode(
            SimNodeConfig(
                node_id=node_id,
                url=node_url(base_url, node_id),
                region=entry.get("region", ""),
                memory_mib=int(entry.get("memoryMib", 64 * 1024)),
                times=times,
            )
        )
        for vm_id, tenant_id, incarnation, last_ms, live_by in entry.get("running", []):
            node.seed_running(vm_id, tenant_id, incarnation, last_ms, live_by)
        for vm_id, snapshot_id in entry.get("snapshots", []):
            node.seed_snapshot(vm_id, snapshot_id)
        nodes.append(node)
    return nodes


def app_of(nodes: list[SimNode], secret: str) -> Starlette:
    async def sim(_: Request) -> JSONResponse:
        return JSONResponse(
            {n.node_id: {"calls": n.calls, "vms": len(n.vms), "epoch": n.epoch} for n in nodes}
        )

    routes: list[Any] = [Route("/_sim", sim)]
    for n in nodes:
        # The simulated node stands where a NodeRuntime stands: the same verbs from its own
        # handler table (tests/unit/test_simnode.py keeps the two in step).
        rpc = create_rpc_app(n.handlers(), token=node_token(secret, n.node_id))
        routes.append(Mount(PREFIX + n.node_id, app=rpc))
    return Starlette(routes=routes)


async def run(
    nodes: list[SimNode], secret: str, port: int, servers: list[str], interval_s: float, stop: asyncio.Event
) -> None:
    server = _Server(http_config(app_of(nodes, secret), host="127.0.0.1", port=port, lifespan="off",
                                 backlog=4096))  # fmt: skip
    serving = asyncio.create_task(server.serve(), name="sim-rpc")
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.01)
    http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=64))
    beats = [
        Heartbeats(n.heartbeat, servers, node_token(secret, n.node_id), interval_s, http=http) for n in nodes
    ]

    async def beat(b: Heartbeats) -> None:
        await asyncio.sleep(random.uniform(0, interval_s))  # spread, as real nodes started apart are
        await b.run()

    tasks = [
        asyncio.create_task(beat(b), name=f"beat-{n.node_id}") for b, n in zip(beats, nodes, strict=True)
    ]
    print(f"simnodes ready: {len(nodes)} nodes on 127.0.0.1:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await http.aclose()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await serving


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=Path, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--server", action="append", required=True, help="a control-plane replica's URL")
    ap.add_argument("--interval", type=float, default=5.0, help="heartbeat period, seconds")
    ap.add_argument("--spawn-ms", type=float, default=SimTimes.spawn_ms)
    ap.add_argument("--restore-ms", type=float, default=SimTimes.restore_ms)
    ap.add_argument("--snapshot-ms", type=float, default=SimTimes.snapshot_ms)
    ap.add_argument("--stop-ms", type=float, default=SimTimes.stop_ms)
    ap.add_argument("--exec-ms", type=float, default=SimTimes.exec_ms)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret = Settings.from_env(Path(tempfile.gettempdir())).cluster_secret
    if not secret:
        raise SystemExit("PAL_CLUSTER_SECRET is not set: the nodes' tokens derive from it")
    times = SimTimes(args.spawn_ms, args.restore_ms, args.snapshot_ms, args.stop_ms, args.exec_ms)
    seed = json.loads(args.seed.read_text())
    base = f"http://127.0.0.1:{args.port}"

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(build(seed, base, times), secret, args.port, args.server, args.interval, stop)

    asyncio.run(go())


if __name__ == "__main__":
    main()
