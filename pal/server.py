"""`pal up`: the control plane and an embedded runtime manager in one process.

The scheduler talks to the embedded manager through the same RPC client (over the
manager's unix socket) a remote node would use: one code path. SIGTERM/SIGINT stop every
VM this process started, then the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn

from pal.config import Settings

log = logging.getLogger("pal")

DEFAULT_TEMPLATE_MEM_MIB = 256
DEFAULT_TEMPLATE_VCPUS = 1


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve()` below owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _logging() -> None:
    level = os.environ.get("PAL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Per-request and per-QMP-event lines drown what matters.
    for noisy in ("httpx", "httpcore", "alembic", "qemu.qmp", "botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # qemu.qmp logs every refused connect while QEMU is still starting; we report real failures.
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)


class Node:
    """The embedded runtime manager: snapshot store + VM runtime + its RPC server."""

    def __init__(self, settings: Settings) -> None:
        from pal.images.templates import TemplateCache
        from pal.manager.runtime import NodeRuntime
        from pal.snapshots.s3 import S3Mirror
        from pal.snapshots.store import SnapshotStore
        from pal.vmm.accel import probe

        self.settings = settings
        self.accel = probe(settings)
        log.info("accelerator: %s (%s)", self.accel.name, self.accel.reason)
        mirror = (
            S3Mirror(
                settings.s3_endpoint,
                settings.s3_bucket or "",
                settings.s3_region,
                logging.getLogger("pal.s3"),
            )
            if settings.s3_enabled
            else None
        )
        if mirror is not None:
            log.info("snapshot mirror: S3 %s bucket %s", settings.s3_endpoint, settings.s3_bucket)
        self.store = SnapshotStore(settings.snapshots_root, mirror)
        self.store.cleanup_staging()
        self.runtime = NodeRuntime(settings, self.store, self.accel)
        self.runtime.templates = (
            TemplateCache(settings.data_dir / "templates") if settings.templates else None
        )

    def rpc_server(self) -> _Server:
        from pal.manager.rpc import create_rpc_app

        sock = self.settings.manager_socket
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        cfg = uvicorn.Config(create_rpc_app(self.runtime), uds=str(sock), log_level="warning", lifespan="off")
        return _Server(cfg)

    def warm_default_template(self) -> None:
        from pal.images.paths import load_image

        if self.runtime.templates is None:
            return
        with contextlib.suppress(Exception):
            image = load_image(self.settings, "default")
            self.runtime.templates.prune({image.agent_version_id})
            self.runtime.templates.ensure_in_background(
                self.runtime, image, DEFAULT_TEMPLATE_MEM_MIB, DEFAULT_TEMPLATE_VCPUS
            )


def prepare_data_dir(settings: Settings) -> str:
    """Make the data dir exist on a reflink-capable file system; say what was done."""
    from pal.vmm.datadir import ensure_reflink_datadir

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return ensure_reflink_datadir(settings, log.info)


def ensure_image(settings: Settings, name: str = "default") -> None:
    """Build the image when it is missing or its harness changed (a no-op otherwise)."""
    from pal.images.builder import build_image

    build_image(settings, name, progress=lambda step, frac: log.info("image: %s %.0f%%", step, frac * 100))


async def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8080) -> None:
    from pal.api.app import create_app
    from pal.manager.client import ManagerClient
    from pal.scheduler.scheduler import Scheduler
    from pal.store import Store

    prepare_data_dir(settings)
    await asyncio.to_thread(ensure_image, settings)
    node = Node(settings)
    adopted, killed = await node.runtime.adopt_all()
    if adopted or killed:
        log.warning("VMs left by a previous run: adopted %s, killed %s", adopted, killed)
    rpc = node.rpc_server()
    rpc_task = asyncio.create_task(rpc.serve(), name="manager-rpc")
    while not rpc.started:
        if rpc_task.done():
            rpc_task.result()
        await asyncio.sleep(0.01)

    client = ManagerClient(settings.manager_socket)
    store = Store.open(settings)
    scheduler = Scheduler(settings, store, client)
    await scheduler.start()
    node.warm_default_template()

    async def health() -> dict[str, Any]:
        from pal.images.paths import load_image

        load_image(settings, "default")
        hb = await client.heartbeat()
        return {"ok": True, "accel": hb.accel, "vms": len(hb.vms)}

    app = create_app(scheduler, store, settings, health=health)
    api = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    api_task = asyncio.create_task(api.serve(), name="api")
    log.info(
        "Pal is up on http://%s:%d (data dir %s, accel %s)", host, port, settings.data_dir, node.accel.name
    )
    try:
        done, _ = await asyncio.wait(
            {api_task, rpc_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
        )
        for t in done:
            if t is not stop and t.exception() is not None:
                log.error("server task failed: %s", t.exception())
    finally:
        log.info("stopping: every VM this server started is being stopped")
        api.should_exit = True
        with contextlib.suppress(Exception):
            await scheduler.shutdown_vms()
        await scheduler.close()
        await node.runtime.stop_all()
        await asyncio.to_thread(node.store.close)
        rpc.should_exit = True
        await asyncio.gather(api_task, rpc_task, return_exceptions=True)
        await client.aclose()
        store.close()


def run(settings: Settings, host: str = "127.0.0.1", port: int = 8080) -> None:
    _logging()
    asyncio.run(serve(settings, host, port))


def doctor(settings: Settings) -> dict[str, Any]:
    """What this host gives Pal: accelerator, reflink, QEMU and kernel versions."""
    from pal.vmm import cgroups, disks
    from pal.vmm.accel import probe
    from pal.vmm.versions import qemu_version

    out: dict[str, Any] = {"dataDir": str(settings.data_dir)}
    out["qemu"] = qemu_version()
    try:
        info = probe(settings)
        out["accelerator"] = f"{info.name} ({info.reason})"
    except Exception as exc:
        out["accelerator"] = f"unknown ({exc})"
    d = settings.data_dir if settings.data_dir.exists() else Path("/tmp")
    out["reflink"] = "yes (reflink clones)" if disks.reflink_supported(d) else "no (qcow2 overlays)"
    out["cgroups"] = cgroups.describe()
    try:
        from pal.images.paths import load_image

        img = load_image(settings, "default")
        out["image"] = img.agent_version_id
        out["kernel"] = img.meta.get("kernelVersion")
    except Exception as exc:
        out["image"] = f"missing ({exc})"
    out["snapshotDir"] = str(settings.snapshots_root)
    out["s3"] = f"{settings.s3_endpoint}/{settings.s3_bucket}" if settings.s3_enabled else "off"
    return out
