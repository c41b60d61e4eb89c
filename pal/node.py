"""`pal node`: one per machine: the runtime manager of this host, reached by the control
plane over HTTP (authenticated by this node's token, listening on 127.0.0.1 unless told
otherwise), and its heartbeat to the control plane every ``PAL_NODE_HEARTBEAT_INTERVAL``
seconds (capacity, VMs, warm templates, images, health).

Stopping a node (SIGTERM) leaves its VMs running: a restarted node adopts them. A node away
for longer than ``PAL_NODE_LOST_AFTER`` has lost its running VMs (the control plane fails
them); when it comes back, the control plane stops their QEMUs. To take a node out of
service, drain it first (`pal node drain`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import httpx

from pal.api.callers import NODE_HEADER
from pal.config import Settings
from pal.errors import InvalidRequest
from pal.server import Node, _logging, _Server, ensure_image, http_config, prepare_data_dir, secure_umask
from pal.wire.models import HeartbeatAck, NodeHeartbeat

log = logging.getLogger("pal.node")


class Heartbeats:
    """Pushes the node's heartbeat (``report()``: the runtime's) to the control plane,
    trying each server URL in turn (any replica: followers forward it to the leader).
    ``http``: a client to share (the benchmark's simulated nodes, many in one process);
    by default one of its own."""

    def __init__(
        self,
        report: Callable[[], Awaitable[NodeHeartbeat]],
        servers: list[str],
        token: str,
        interval_s: float,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.report = report
        self.servers = [s.rstrip("/") for s in servers]
        self.interval_s = interval_s
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(10.0))
        self._auth = {"Authorization": f"Bearer {token}"}
        self._next = 0
        self.last_ack: HeartbeatAck | None = None

    async def send_once(self) -> HeartbeatAck | None:
        hb = await self.report()
        body = hb.model_dump(by_alias=True, mode="json")
        for i in range(len(self.servers)):
            url = self.servers[(self._next + i) % len(self.servers)]
            try:
                # X-Pal-Node: a follower checks the token before it holds the body (forward.py).
                resp = await self._http.post(
                    url + "/v1/nodes/heartbeat", json=body, headers={NODE_HEADER: hb.node_id, **self._auth}
                )
            except httpx.HTTPError as exc:
                log.warning("heartbeat to %s failed: %s", url, exc)
                continue
            if resp.status_code == 200:
                self._next = (self._next + i) % len(self.servers)
                ack = HeartbeatAck.model_validate(resp.json())
                if self.last_ack is None or ack.state != self.last_ack.state:
                    log.info(
                        "registered with the control plane at %s: node %s is %s", url, ack.node_id, ack.state
                    )
                if ack.stopping:
                    log.warning("control plane stops VMs this node must not run: %s", ack.stopping)
                self.last_ack = ack
                return ack
            log.warning("heartbeat to %s answered %s: %s", url, resp.status_code, resp.text[:200])
        return None

    async def run(self) -> None:
        while True:
            try:
                await self.send_once()
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()


async def serve_node(
    settings: Settings,
    servers: list[str],
    host: str = "127.0.0.1",
    port: int = 8081,
    advertise: str | None = None,
) -> None:
    if not settings.node_token:
        raise InvalidRequest(
            "PAL_NODE_TOKEN is not set: print it with `pal node token NAME` on a control-plane host"
        )
    if not servers:
        raise InvalidRequest("no control plane given: --server URL (or PAL_SERVERS)")
    from pal.manager.rpc import create_rpc_app

    prepare_data_dir(settings)
    await asyncio.to_thread(ensure_image, settings)
    node = Node(settings)
    node.runtime.me.url = advertise or f"http://{host}:{port}"  # where the control plane reaches it
    adopted, killed = await node.runtime.start()  # the egress gateway (or the one a previous run left)
    if adopted or killed:
        log.warning("VMs left by a previous run: adopted %s, killed %s", adopted, killed)
    sampler = asyncio.create_task(node.runtime.sampler.run(), name="vm-metrics")
    app = create_rpc_app(node.runtime.handlers(), token=settings.node_token)
    rpc = _Server(http_config(app, host=host, port=port, lifespan="off"))
    rpc_task = asyncio.create_task(rpc.serve(), name="node-rpc")
    while not rpc.started:
        if rpc_task.done():
            rpc_task.result()
        await asyncio.sleep(0.01)
    node.warm_default_template()
    node.runtime.start_pool()
    beats = Heartbeats(
        node.runtime.reports.heartbeat, servers, settings.node_token, settings.node_heartbeat_interval_s
    )
    beat_task = asyncio.create_task(beats.run(), name="node-heartbeat")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("Pal node %s on %s (data dir %s, accel %s)", node.runtime.me.node_id, node.runtime.me.url,
             settings.data_dir, node.accel.name)  # fmt: skip
    try:
        await asyncio.wait({rpc_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        beat_task.cancel()
        sampler.cancel()
        rpc.should_exit = True
        await asyncio.gather(rpc_task, beat_task, sampler, return_exceptions=True)
        await beats.aclose()
        await node.runtime.detach()  # its VMs keep running: the next start adopts them
        await asyncio.to_thread(node.store.close)


def run(settings: Settings, servers: list[str], host: str, port: int, advertise: str | None) -> None:
    secure_umask()
    _logging(settings)
    asyncio.run(serve_node(settings, servers, host, port, advertise))
