"""`pal up`: the control plane and an embedded runtime manager in one process.

The scheduler talks to the embedded manager through the same RPC client (over the
manager's unix socket) a remote node would use: one code path. SIGTERM/SIGINT suspend every
running VM (snapshot + stop, as an idle suspend: the next request after a restart wakes it),
stop the VMs caught mid-spawn or mid-drain, then the servers. No QEMU outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import uvicorn

from pal import operator
from pal.api.hosts import WILDCARD_HOSTS
from pal.config import PORTS_PORT_OFFSET, Settings
from pal.wire.tunnel import MAX_FRAME

if TYPE_CHECKING:
    from pal.scheduler.scheduler import Scheduler
    from pal.wire.handlers import NodeCalls

log = logging.getLogger("pal")


# How long our servers keep an idle connection open: well past any client's reuse window
# (httpx keeps one 5 s, Node's undici 4 s). At uvicorn's default (5 s) the server could close
# a connection at the moment a client sent a request on it; the request was reset, and an
# exec to a node that was there failed as 503 NODE_UNREACHABLE.
KEEP_ALIVE_S = 75
# The largest WebSocket message any of our servers takes (uvicorn's default is 16 MiB): a port
# tunnel's frame (pal/manager/tunnel.py MAX_FRAME), above an attach's stdin frame (64 KiB). A
# bigger one closes that socket (1009) before it is buffered.
WS_MAX_BYTES = MAX_FRAME


def http_config(app: Any, **kw: Any) -> uvicorn.Config:
    """uvicorn's config for each of our servers (the API, the ports listener, a node's RPC)."""
    return uvicorn.Config(
        app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S, ws_max_size=WS_MAX_BYTES, **kw
    )


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve()` below owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _logging(settings: Settings) -> None:
    level = settings.log_level
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pal.api.middleware import RequestIdFilter

    for handler in logging.getLogger().handlers:  # lines written during a request name its id
        handler.addFilter(RequestIdFilter())
    # Per-request and per-QMP-event lines drown what matters.
    for noisy in ("httpx", "httpcore", "alembic", "qemu.qmp", "botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # qemu.qmp logs every refused connect while QEMU is still starting; we report real failures.
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)


class Node:
    """The embedded runtime manager: snapshot store + VM runtime + its RPC server."""

    def __init__(self, settings: Settings) -> None:
        from pal.manager.runtime import NodeRuntime
        from pal.manager.templates import TemplateCache
        from pal.snapshots.store import SnapshotStore
        from pal.vmm.accel import probe

        self.settings = settings
        self.accel = probe(settings)
        log.info("accelerator: %s (%s)", self.accel.name, self.accel.reason)
        self.store = SnapshotStore.from_settings(settings)
        if self.store.mirror is not None:
            log.info("snapshot mirror: S3 %s bucket %s", settings.s3_endpoint, settings.s3_bucket)
        self.store.cleanup_staging()
        templates = TemplateCache.from_settings(settings) if settings.templates else None
        self.runtime = NodeRuntime(settings, self.store, self.accel, templates)
        self._log_limits()

    def _log_limits(self) -> None:
        """What this host gives VMs, once at start: each missing or turned-off capability
        with its effect and fix (pal/manager/hostcaps.py; `pal doctor` shows the same)."""
        from pal.manager import hostcaps
        from pal.vmm import cgroups

        try:
            caps = hostcaps.report(self.settings, hostcaps.HostView(cgroup_host=cgroups.host))
        except Exception as exc:  # a probe that breaks must not keep the node from starting
            log.warning("host capabilities could not be probed: %s; see `pal doctor`", exc)
            return
        used = ", ".join(c.name for c in caps if c.state == "used")
        log.info("host: %s used (`pal doctor` says how)", used)
        for c in caps:
            if c.stops_vms:
                log.error("host: %s %s; no VM can start", c.name, c.line())
            elif c.state in ("missing", "off"):
                log.warning("host: %s %s", c.name, c.line())

    def rpc_server(self) -> tuple[_Server, socket.socket]:
        """The manager's RPC server and its socket (root-only: see rpc_socket.py)."""
        from pal.manager import rpc_socket
        from pal.manager.rpc import create_rpc_app

        sock = rpc_socket.bind(self.settings.manager_socket)
        app = create_rpc_app(self.runtime.handlers())
        cfg = http_config(app, lifespan="off", http=rpc_socket.PeerCheckedProtocol)
        return _Server(cfg), sock

    def warm_default_template(self) -> None:
        """Build the template of the default image at the default size (AgentSpec's)."""
        from pal.images.paths import list_images, load_image
        from pal.sizes import size_name
        from pal.spec import Limits

        if self.runtime.templates is None:
            return
        size = Limits.model_validate({})
        with contextlib.suppress(Exception):
            # Templates of image builds that no longer exist go; every current image keeps its own.
            self.runtime.templates.prune({i.agent_version_id for i in list_images(self.settings)})
            image = load_image(self.settings, "default")
            self.runtime.templates.ensure_in_background(
                self.runtime.template_host, image, size_name(size.memory_mib, size.vcpus, size.disk_mib)
            )


def secure_umask() -> None:
    """Files Pal creates are root's alone (0600/0700) unless it says otherwise."""
    os.umask(0o077)


def prepare_data_dir(settings: Settings) -> str:
    """Make the data dir exist, root-only (0700), on a reflink-capable file system; say
    what was done."""
    from pal.vmm.datadir import ensure_reflink_datadir

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    action = ensure_reflink_datadir(settings, log.info)
    os.chmod(settings.data_dir, 0o700)  # the mount's root, when it is a loop XFS
    return action


def ensure_image(settings: Settings, name: str = "default") -> None:
    """Build the image when it is missing or its harness changed (a no-op otherwise), and
    re-assemble imported and Dockerfile images built from older guest files."""
    from pal.images.builder import build_image
    from pal.images.importer import refresh_stale

    build_image(settings, name, progress=lambda step, frac: log.info("image: %s %.0f%%", step, frac * 100))
    for image, error in refresh_stale(settings).items():
        if error:
            log.error("image %s could not be re-assembled with the new guest files: %s", image, error)
        else:
            log.info("image %s re-assembled with the new guest files", image)


def drop_unused_templates(settings: Settings, digest: str | None) -> None:
    """Remove the templates of an image build no image refers to any more (replaced or
    removed). Builds in progress are left to the server that runs them."""
    from pal.images.paths import list_images
    from pal.manager.templates import TemplateCache

    if digest and all(i.agent_version_id != digest for i in list_images(settings)):
        TemplateCache(settings.data_dir / "templates").drop(digest)


def remove_image(settings: Settings, name: str) -> None:
    """Remove image ``name`` and its templates (callers check that no VM needs it)."""
    from pal.images.importer import remove_image as remove
    from pal.images.paths import load_image

    digest = load_image(settings, name).agent_version_id
    remove(settings, name)
    drop_unused_templates(settings, digest)


async def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8080) -> None:
    from pal.scheduler.node_client import HttpNode
    from pal.scheduler.scheduler import Scheduler
    from pal.store import Store

    ports_sock = bind_ports_listener(settings, host, port)  # checked before anything starts
    e2b_sock = bind_e2b_listener(settings, host)
    prepare_data_dir(settings)
    if not settings.admin_token:
        log.info("operator token: %s (root's `pal` CLI on this host reads it)", operator.token_path(settings))
    settings.admin_token = operator.server_token(settings, replica=False)
    await asyncio.to_thread(ensure_image, settings)
    node = Node(settings)
    adopted, killed = await node.runtime.start()
    if adopted or killed:
        log.warning("VMs left by a previous run: adopted %s, killed %s", adopted, killed)
    sampler = asyncio.create_task(node.runtime.sampler.run(), name="vm-metrics")
    rpc, rpc_sock = node.rpc_server()
    rpc_task = asyncio.create_task(rpc.serve(sockets=[rpc_sock]), name="manager-rpc")
    while not rpc.started:
        if rpc_task.done():
            rpc_task.result()
        await asyncio.sleep(0.01)

    client = HttpNode(settings.manager_socket, max_streams=settings.node_max_streams)
    store = Store.open(settings)
    # `pal up` is one machine's everything: a `pal server` sharing its database would run on
    # this machine too, where 127.0.0.1 reaches it.
    local = f"http://127.0.0.1:{port}" if host in WILDCARD_HOSTS else None
    scheduler = Scheduler(settings, store, client, leader=leadership(settings, store, host, port, local))
    await scheduler.start()
    node.warm_default_template()
    node.runtime.start_pool()

    health = _node_health(settings, client, scheduler)
    from pal.dashboard.session import load_secret

    names = hosts(settings, host, local)
    app = control_plane_app(
        scheduler, store, settings, health, load_secret(settings), names, node_host_checks(settings)
    )
    served = _serve(app, host, port, ports_sock)
    if e2b_sock is not None:
        agent = _Server(http_config(app.state.e2b_agent, lifespan="off"))
        served.tasks.append(asyncio.create_task(agent.serve(sockets=[e2b_sock]), name="e2b-agent"))
        served.extra.append(agent)
        log.info("E2B agent listener on %s:%d (`pal e2b env`)", *e2b_sock.getsockname()[:2])
    log.info(
        "Pal is up on http://%s:%d (data dir %s, accel %s); dashboard at http://%s:%d/runtime; %s",
        host,
        port,
        settings.data_dir,
        node.accel.name,
        host,
        port,
        _ports_line(app, ports_sock),
    )
    try:
        done, _ = await asyncio.wait(
            {*served.tasks, rpc_task, asyncio.create_task(served.stop.wait())},
            return_when=asyncio.FIRST_COMPLETED,
        )
        for t in done:
            if t.exception() is not None:
                log.error("server task failed: %s", t.exception())
    finally:
        log.info("stopping: running VMs are suspended (they wake on their next request), the rest stopped")
        served.exit()
        with contextlib.suppress(Exception):
            await scheduler.draining.shutdown_vms()
        await scheduler.close()
        sampler.cancel()
        await node.runtime.shutdown()
        await asyncio.to_thread(node.store.close)
        rpc.should_exit = True
        await asyncio.gather(*served.tasks, rpc_task, return_exceptions=True)
        await client.aclose()
        store.close()


def node_host_checks(settings: Settings) -> Callable[[], list[dict[str, Any]]]:
    """`pal doctor`'s host rows as this node sees its host, with the settings it runs with
    (GET /v1/operator/host): the cgroup layout it discovered and prepared, not a new one."""

    def checks() -> list[dict[str, Any]]:
        from pal.manager.hostcaps import HostView
        from pal.ops.doctor import host_checks
        from pal.vmm import cgroups

        return [c.as_json() for c in host_checks(settings, HostView(cgroup_host=cgroups.host))]

    return checks


def _node_health(
    settings: Settings, client: NodeCalls, scheduler: Scheduler
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """/healthz of `pal up`: the default image, cgroups and seccomp usable, the node answering."""

    async def health() -> dict[str, Any]:
        from pal.errors import Unavailable
        from pal.images.paths import load_image
        from pal.vmm import cgroups
        from pal.vmm.versions import qemu_supports_sandbox

        load_image(settings, "default")
        if settings.cgroups:
            cgroups.host()  # fail closed: no VM can start without its limits
        if settings.seccomp and not qemu_supports_sandbox():
            raise Unavailable("QEMU has no -sandbox (seccomp): no VM can start; see `pal doctor`")
        from pal.wire import verbs
        from pal.wire.models import Empty

        hb = await client.call(verbs.HEARTBEAT, Empty())
        return {"ok": True, "accel": hb.accel, "vms": len(hb.vms), **await role(scheduler)}

    return health


@dataclass
class _Listeners:
    """A serving process's API and ports listener, their tasks, and ``stop``: set by
    SIGTERM or SIGINT."""

    api: _Server
    ports: _Server
    tasks: list[asyncio.Task[None]]
    stop: asyncio.Event
    extra: list[_Server] = field(default_factory=list)  # the E2B agent listener of `pal up`

    def exit(self) -> None:
        self.api.should_exit = True
        self.ports.should_exit = True
        for server in self.extra:
            server.should_exit = True


def _serve(app: Any, host: str, port: int, ports_sock: socket.socket) -> _Listeners:
    """Serve the control plane's app and the ports listener: VM ports on their own origins,
    nothing else (never the API or the dashboard: pal/api/port_origins.py)."""
    from pal.api.port_origins import ports_listener_app

    api = _Server(http_config(app, host=host, port=port, lifespan="on"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listener = ports_listener_app(app.state.ports_app, app.state.port_origins)
    ports = _Server(http_config(listener, lifespan="off"))
    tasks = [
        asyncio.create_task(api.serve(), name="api"),
        asyncio.create_task(ports.serve(sockets=[ports_sock]), name="ports"),
    ]
    return _Listeners(api, ports, tasks, stop)


def bind_ports_listener(settings: Settings, host: str, api_port: int) -> socket.socket:
    """The ports listener's socket, on the API's address, bound before anything starts so
    that a port in use (or a PAL_PORTS_DOMAIN naming nothing) is said at once. Its port:
    PAL_PORTS_PORT (`--ports-port`) when given, else the API's + 2, else (that one taken) a
    free one the kernel picks; ``settings.ports_port`` is set to it (the VM ports' links)."""
    from pal.api.port_origins import PortsOrigins

    try:
        PortsOrigins.from_settings(settings)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    derived = api_port + PORTS_PORT_OFFSET if api_port + PORTS_PORT_OFFSET <= 65535 else 0
    tries = [settings.ports_port] if settings.ports_port is not None else [derived, 0]
    for port in tries:
        try:
            sock = socket.create_server((host.strip("[]"), port), family=family)
        except OSError as exc:
            if settings.ports_port is None and exc.errno == errno.EADDRINUSE and port:
                log.warning(
                    "port %d (the API's + %d) is taken: VM ports get a free one", port, PORTS_PORT_OFFSET
                )
                continue
            raise SystemExit(
                f"the ports listener cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(choose another with --ports-port or PAL_PORTS_PORT)"
            ) from None
        settings.ports_port = sock.getsockname()[1]
        return sock
    raise AssertionError("port 0 always binds or raises")


def bind_e2b_listener(settings: Settings, host: str) -> socket.socket | None:
    """The E2B agent listener's socket (PAL_E2B_PORT on the API's address; None when it
    is 0), bound before anything starts so that a port in use is said at once."""
    if not settings.e2b_port:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), settings.e2b_port), family=family)
    except OSError as exc:
        raise SystemExit(
            f"the E2B agent listener cannot listen on {host}:{settings.e2b_port}: {exc.strerror or exc} "
            "(choose another with PAL_E2B_PORT, or 0 for none)"
        ) from None


def _ports_line(app: Any, sock: socket.socket) -> str:
    where = sock.getsockname()
    return f"VM ports at {app.state.port_origins.pattern()} (listener {where[0]}:{where[1]})"


def run(settings: Settings, host: str = "127.0.0.1", port: int = 8080) -> None:
    secure_umask()
    _logging(settings)
    asyncio.run(serve(settings, host, port))


def advertised_url(host: str, port: int, advertise: str | None) -> str:
    """The URL the other replicas forward to this one at (it goes into the leader lease).
    Bound to every interface, this replica cannot know which address the others reach it
    at (127.0.0.1 would make each follower forward to itself): the operator must say.
    ValueError, naming the fix, when it cannot be known or is not a reachable URL."""
    if advertise:
        url = urlsplit(advertise)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"--advertise-url must be an http(s) URL with a host, got {advertise!r}")
        if url.hostname in WILDCARD_HOSTS:
            raise ValueError(f"--advertise-url {advertise!r} names no machine: give an address others reach")
        return advertise.rstrip("/")
    if host in WILDCARD_HOSTS:
        raise ValueError(
            f"pal server listens on all interfaces ({host or '*'}): give --advertise-url "
            "(PAL_ADVERTISE_URL in deploy/server.env), the URL the other replicas reach this one at"
        )
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def leadership(settings: Settings, store: Any, host: str, port: int, advertise: str | None = None) -> Any:
    """PostgreSQL: a lease with a fencing token (replicas may run beside this one).
    SQLite: the only replica, always the leader."""
    from pal.scheduler.leader import LeaseLeader, SingleProcessLeader

    if store.dialect != "postgresql":
        return SingleProcessLeader()
    return LeaseLeader(store, advertised_url(host, port, advertise), ttl_s=settings.leader_lease_s)


async def role(scheduler: Scheduler) -> dict[str, Any]:
    leads = await scheduler.leader.is_leader()
    out: dict[str, Any] = {"role": "leader" if leads else "follower"}
    token = getattr(scheduler.leader, "token", None)
    if leads and token is not None:
        out["fencingToken"] = token
    if leads:
        out["reconciled"] = scheduler.background.reconciled
        out["loops"] = scheduler.telemetry.loops.report()
        out["eventLoopLagMaxSecs"] = round(getattr(scheduler.leader, "max_lag_s", 0.0), 3)
    if not leads:
        with contextlib.suppress(Exception):
            out["leader"] = await scheduler.leader.leader_url()
    return out


def hosts(settings: Settings, host: str, advertise: str | None) -> Any:
    """The names the API and dashboard answer as (pal/api/hosts.py)."""
    from pal.api.hosts import AllowedHosts

    return AllowedHosts.for_server(settings, host, advertise)


def control_plane_app(
    scheduler: Scheduler,
    store: Any,
    settings: Settings,
    health: Any,
    secret: bytes,
    allowed_hosts: Any = None,
    host_checks: Any = None,
) -> Any:
    """The control plane's app (`pal up` and every `pal server`): the REST API, operator
    routes and the dashboard, its sessions and port links signed with ``secret`` (replicas
    share it), answering for ``allowed_hosts`` (pal/api/hosts.py). A follower forwards
    what it cannot answer itself, dashboard actions included (pal/api/forward.py)."""
    from pal.api.app import create_app
    from pal.api.auth import key_check
    from pal.dashboard.app import install_dashboard
    from pal.mcp.http import install_mcp

    app = create_app(
        scheduler,
        store,
        settings,
        health=health,
        link_secret=secret,
        hosts=allowed_hosts,
        host_checks=host_checks,
    )
    install_dashboard(app, scheduler, store, settings, secret)
    install_mcp(  # /mcp: the MCP server (docs/agents.md)
        app,
        lambda key: key_check(store, key),
        max_per_tenant=settings.tenant_max_streams,
        cors_origins=tuple(settings.cors_origins),
    )
    install_e2b(app, scheduler, store, secret, settings.e2b_idle_timeout_s)
    return app


def install_e2b(app: Any, scheduler: Scheduler, store: Any, secret: bytes, idle_timeout_s: int = 0) -> None:
    """E2B's protocol (docs/e2b.md): its REST API mounted at /e2b (the API's middleware,
    so leader forwarding and host checks, around it), and the agent listener's app, which
    `pal up` serves on PAL_E2B_PORT (``app.state.e2b_agent``). Both over the scheduler's
    operations, bound once here (pal/e2b/binding.py)."""
    from pal.api.auth import key_check
    from pal.e2b.agent import AgentConfig, create_agent_app
    from pal.e2b.binding import bind
    from pal.e2b.rest import RestConfig, create_rest_app
    from pal.e2b.sandboxes import PalSandboxes
    from pal.e2b.volumes import routers as volume_routers

    s = scheduler
    sandboxes = PalSandboxes(
        s.scheduling,
        s.reads,
        s.listing,
        s.deleting,
        s.lifetimes,
        s.pauses,
        s.forking,
        s.egress_secrets,
        s.guest,
        s.kept,
        secret,
        idle_timeout_s=idle_timeout_s,
    )
    bound = bind(sandboxes, store, lambda key: key_check(store, key))
    more = volume_routers(s.volumes, secret)  # /volumes and the volume content API
    app.mount("/e2b", create_rest_app(bound.sandboxes, bound.keys.check, RestConfig(), bound.keys, more))
    app.state.e2b_agent = create_agent_app(bound.backend, AgentConfig())


async def serve_control_plane(
    settings: Settings, host: str = "127.0.0.1", port: int = 8080, advertise: str | None = None
) -> None:
    """`pal server`: API, scheduler, dashboard and operator routes, no node of its own.
    Several run against one PostgreSQL; the leader mutates, followers forward
    (pal/api/forward.py)."""
    from pal.dashboard.session import load_secret
    from pal.scheduler.scheduler import Scheduler
    from pal.store import Store, redacted

    advertise = advertised_url(host, port, advertise)  # checked before anything starts
    ports_sock = bind_ports_listener(settings, host, port)
    # Port links are signed with it: replicas share it (checked before anything starts).
    link_secret = load_secret(settings, replica=True)
    settings.admin_token = operator.server_token(settings, replica=True)
    if settings.admin_token is None:
        log.warning("no PAL_ADMIN_TOKEN or PAL_CLUSTER_SECRET: the operator's routes open for no one")
    store = Store.open(settings)
    scheduler = Scheduler(settings, store, leader=leadership(settings, store, host, port, advertise))
    await scheduler.start()

    async def health() -> dict[str, Any]:
        return {"ok": True, "nodes": len(scheduler.nodes.nodes()), **await role(scheduler)}

    app = control_plane_app(scheduler, store, settings, health, link_secret, hosts(settings, host, advertise))
    served = _serve(app, host, port, ports_sock)
    log.info(
        "Pal control plane on http://%s:%d (store %s); dashboard at /runtime; %s",
        host,
        port,
        redacted(store.url),
        _ports_line(app, ports_sock),
    )
    try:
        await asyncio.wait(
            {*served.tasks, asyncio.create_task(served.stop.wait())}, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        # VMs live on the nodes: stopping a replica stops none of them; the lease is released
        # so another replica takes over at once.
        served.exit()
        await scheduler.close()
        await asyncio.gather(*served.tasks, return_exceptions=True)
        store.close()


def run_control_plane(settings: Settings, host: str, port: int, advertise: str | None) -> None:
    _logging(settings)
    asyncio.run(serve_control_plane(settings, host, port, advertise))
