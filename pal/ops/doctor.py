"""`pal doctor`: what this host gives Pal and whether each part of a running Pal answers.

Host checks (one per capability: pal/manager/hostcaps.py; the data dir, the image) are the
running server's when one answers GET /v1/operator/host (its settings, probed by it), else
made here with this shell's settings; the store is opened read-only (never migrated); the
server is asked for /healthz, whose report includes the runtime manager's heartbeat. A
check is ok, failed (VMs cannot start for it: doctor exits 1), or only informative
(``ok=None``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from pal.config import Settings
from pal.operator import client_token

if TYPE_CHECKING:
    from pal.manager.hostcaps import HostView

log = logging.getLogger("pal.doctor")
# Where the operator token comes from (pal/operator.py), said when doctor has none.
NO_TOKEN = "run as root on the server's host, or set PAL_ADMIN_TOKEN"


@dataclass
class Check:
    name: str
    ok: bool | None  # None: information, not a pass/fail
    detail: str

    def as_json(self) -> dict[str, Any]:
        """As `pal doctor --json` and GET /v1/operator/host show it."""
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


def _run(name: str, fn: object) -> Check:
    try:
        return fn()  # type: ignore[operator, no-any-return]
    except Exception as exc:
        return Check(name, False, f"{type(exc).__name__}: {exc}")


def _existing(data_dir: Path) -> Path:
    return data_dir if data_dir.exists() else Path("/tmp")


def host_checks(settings: Settings, view: HostView | None = None) -> list[Check]:
    """One line per host capability (pal/manager/hostcaps.py: used, missing with its
    effect and fix, off, not needed), then the data dir, image and snapshot store."""
    from pal.manager import hostcaps
    from pal.spec import egress_to_json

    def image() -> Check:
        from pal.images.paths import load_image

        img = load_image(settings, "default")
        return Check(
            "image", True, f"default: {img.agent_version_id} (kernel {img.meta.get('kernelVersion')})"
        )

    try:
        caps = [Check(c.name, c.ok, c.line()) for c in hostcaps.report(settings, view)]
    except Exception as exc:
        caps = [Check("host", False, f"{type(exc).__name__}: {exc}")]
    internal = ",".join(settings.egress_allow_internal) or "none"
    egress = f"default {egress_to_json(settings.egress_default)}; internal destinations open: {internal}"
    s3 = f"{settings.s3_endpoint} bucket {settings.s3_bucket}" if settings.s3_enabled else "off"
    return [
        Check("data dir", settings.data_dir.is_dir(), str(settings.data_dir)),
        *caps,
        _run("image", image),
        Check("egress", None, egress),
        Check("snapshots", None, f"{settings.snapshots_root}; S3 mirror {s3}"),
        _volumes(settings.data_dir),
    ]


def _volumes(data_dir: Path) -> Check:
    """Whether sandboxes can mount volumes here (docs/volumes.md: the node's nfs-ganesha),
    and whether a volume's sizeMib is enforced (XFS project quotas on the data dir)."""
    from pal.manager import volume_quota
    from pal.manager.volume_server import PACKAGES, missing_tools

    missing = missing_tools()
    if missing:
        return Check(
            "volumes",
            None,
            f"cannot be mounted: {', '.join(missing)} missing (apt-get install {' '.join(PACKAGES)})",
        )
    from pal.network.resvport import unprivileged_low_ports

    low = unprivileged_low_ports()
    if low is not None:
        return Check(
            "volumes",
            None,
            f"cannot be mounted: net.ipv4.ip_unprivileged_port_start is {low} (below 1024: any local "
            "user could speak to the volume server as a sandbox; set it back to 1024)",
        )
    sizes = (
        "sizeMib enforced (XFS project quotas)"
        if volume_quota.supported(data_dir)
        else "sizeMib not enforced: mount the data dir's XFS with prjquota to hold volumes to their size"
    )
    return Check(
        "volumes", True, f"can be mounted (nfs-ganesha, rpcbind; started at the first mount); {sizes}"
    )


def store_check(settings: Settings) -> Check:
    from pal.store import Store, migrate, redacted

    if settings.database_url:
        url, where = settings.database_url, redacted(settings.database_url)
    elif settings.db_path.is_file():
        url, where = f"sqlite:///{settings.db_path}", str(settings.db_path)
    else:
        return Check("store", False, f"{settings.db_path} does not exist yet (`pal up` creates it)")
    store = Store(url, run_migrations=False)
    try:
        at, want = migrate.current(store.engine), migrate.head()
        if at != want:
            return Check("store", False, f"{where} is at schema {at}, this Pal needs {want}")
        return Check("store", True, f"{where} (schema {at}, {len(store.list_tenants())} tenants)")
    finally:
        store.close()


def server_checks(url: str, token: str | None = None) -> list[Check]:
    """The server at ``url`` and, through its /healthz report, the runtime manager. The
    report's details (accelerator, what failed) come only with the operator's ``token``
    (pal/operator.py, or PAL_METRICS_TOKEN); without it doctor says where they are."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(f"{url.rstrip('/')}/healthz", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        down = f"not reachable at {url} ({exc}); start it with `pal up`"
        return [Check("server", False, down), Check("manager", False, "unknown (the server is down)")]
    report: dict[str, object] = {}
    with contextlib.suppress(ValueError):
        report = dict(resp.json())
    server = Check("server", True, f"up at {url}")
    detailed = "accel" in report or "error" in report
    if resp.status_code == 200 and report.get("ok"):
        detail = (
            f"answers (accel {report.get('accel')}, {report.get('vms')} VMs live)"
            if detailed
            else f"answers (its details need the operator token: {NO_TOKEN})"
        )
        return [server, Check("manager", True, detail)]
    why = report.get("error") or report.get("image") or f"/healthz answered {resp.status_code}"
    if not detailed:
        why = f"{why} (the operator token shows why: {NO_TOKEN}; or read the server log)"
    return [server, Check("manager", False, f"not healthy: {why}")]


def _pool_figures(text: str) -> dict[str, float]:
    """``pal_pool_<figure>{node=...} value`` lines of a /metrics text, summed over nodes."""
    got: dict[str, float] = {}
    for line in text.splitlines():
        name, value = line.partition("{")[0], line.rsplit(" ", 1)[-1]
        if name.startswith("pal_pool_"):
            with contextlib.suppress(ValueError):
                key = name.removeprefix("pal_pool_")
                got[key] = got.get(key, 0.0) + float(value)
    return got


def pool_check(settings: Settings, url: str, token: str | None) -> Check:
    """The warm pool (PAL_POOL) as the server's /metrics reports it: VMs ready of the
    target, their QEMUs' resident memory, claims and misses (docs/lifecycle.md)."""
    wanted = ",".join(f"{size}:{n}" for size, n in settings.pool) or "off"
    if not settings.pool:
        return Check("pool", None, "off (PAL_POOL=0)")
    if not token:
        return Check("pool", None, f"PAL_POOL={wanted}; its state needs the operator token: {NO_TOKEN}")
    try:
        resp = httpx.get(
            f"{url.rstrip('/')}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
    except httpx.HTTPError:
        return Check("pool", None, f"PAL_POOL={wanted}; unknown (the server is down)")
    got = _pool_figures(resp.text) if resp.status_code == 200 else {}
    if not got:
        return Check("pool", None, f"PAL_POOL={wanted}; /metrics answered {resp.status_code}")
    ready, target = int(got.get("ready", 0)), int(got.get("target", 0))
    return Check(
        "pool",
        None,
        f"{ready}/{target} VMs ready (PAL_POOL={wanted}, PAL_POOL_MEMORY_MIB={settings.pool_memory_mib}),"
        f" {got.get('rss_bytes', 0) / (1 << 20):.0f} MiB resident, {int(got.get('claims', 0))} claims,"
        f" {int(got.get('misses', 0))} misses",
    )


def served_host(url: str, token: str | None) -> dict[str, Any] | None:
    """The running server's settings and host rows (GET /v1/operator/host), or None when
    no server answers it (down, no operator token, an older server)."""
    if not token:
        return None
    try:
        resp = httpx.get(
            f"{url.rstrip('/')}/v1/operator/host", headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    with contextlib.suppress(ValueError):
        body = resp.json()
        if isinstance(body, dict) and isinstance(body.get("settings"), dict):
            return body
    return None


def settings_check(served: dict[str, Any], mine: Settings) -> Check:
    """What the server runs with where it differs from this shell's environment."""
    from pal.config_env import effective

    here = effective(mine)
    differ = [
        f"{k}={json.dumps(v)} (this shell: {json.dumps(here.get(k))})"
        for k, v in served.items()
        if here.get(k) != v and v != "(set)"
    ]
    what = "; ".join(differ) if differ else "the same as this shell's"
    return Check("settings", None, f"the server's (the lines below are what it uses): {what}")


def _as_server(settings: Settings, served: dict[str, Any]) -> Settings:
    """``settings`` with the server's data dir and pool, for the store and pool checks."""
    update: dict[str, Any] = {}
    if served.get("PAL_DATA_DIR"):
        update["data_dir"] = Path(served["PAL_DATA_DIR"])
    if isinstance(served.get("PAL_POOL"), list):
        update["pool"] = tuple((str(k), int(n)) for k, n in served["PAL_POOL"])
    if isinstance(served.get("PAL_POOL_MEMORY_MIB"), int):
        update["pool_memory_mib"] = served["PAL_POOL_MEMORY_MIB"]
    return settings.model_copy(update=update)


def run(settings: Settings, url: str) -> list[Check]:
    """Every check. With a server up that answers the operator, the host rows and the
    settings are the server's (what its VMs get), not this shell's environment's."""
    token = client_token(settings) or settings.metrics_token
    served = served_host(url, token)
    if served is None:
        host = host_checks(settings)
    else:
        host = [settings_check(served["settings"], settings)]
        settings = _as_server(settings, served["settings"])
        if served.get("checks") is None:  # a control plane: its nodes run the VMs
            why = "this server runs no VMs itself: `pal node ls`, and `pal doctor` on each node"
            host.append(Check("host", None, why))
        else:
            host += [Check(str(c["check"]), c.get("ok"), str(c["detail"])) for c in served["checks"]]
    return [
        *host,
        _run("store", lambda: store_check(settings)),
        *server_checks(url, token),
        _run("pool", lambda: pool_check(settings, url, token)),
    ]
