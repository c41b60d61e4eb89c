"""`pal`: run the server, build images, manage tenants, and drive sandboxes from a shell.

Server-side commands (up, image, doctor, tenants) import their modules lazily so `pal vm
...` stays fast and works on a machine that has only the SDK's dependencies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from . import code as _code  # noqa: F401  (registers `pal vm code` on vm_app)
from . import help as cli_help
from .bench import bench_app
from .e2b import e2b_app
from .image import DataDir, image_app
from .nodes import node_app
from .output import Table, fail, mode, print_json, print_rows, print_table
from .settings import say, server_settings
from .snapshots import snapshots_app
from .vm import files_app, vm_app
from .vm_processes import vm_app as _processes  # noqa: F401  (registers shell, ps, attach, kill)
from .vm_snapshots import vm_app as _kept  # noqa: F401  (registers snapshot, snapshots, snapshot-rm, start-snapshot)
from .volume_files import volumes_app  # the volumes' commands and their files'

cli_help.install()
app = typer.Typer(
    name="pal",
    help="Pal: self-hostable microVM sandboxes for AI agents.",
    no_args_is_help=True,
    epilog=cli_help.examples(
        "sudo pal up                                  # server + node on this machine",
        "export PAL_API_KEY=$(sudo pal tenants create me -q)",
        "VM=$(pal vm schedule -q)",
        "pal vm exec $VM -- python3 -c 'print(42)'",
        "pal vm pause $VM && pal vm resume $VM",
        "pal vm rm $VM",
    ),
)
tenants_app = typer.Typer(help="Tenants and their API keys (opens the store directly).", no_args_is_help=True)
data_dir_app = typer.Typer(help="The data directory's loop-mounted file system.", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(bench_app, name="bench")
app.add_typer(tenants_app, name="tenants")
app.add_typer(data_dir_app, name="data-dir")
app.add_typer(vm_app, name="vm")
app.add_typer(files_app, name="files")
app.add_typer(volumes_app, name="volumes")
app.add_typer(volumes_app, name="volume", hidden=True)  # `pal volume create|ls|rm|put|get` (issue 34)
app.add_typer(node_app, name="node")
app.add_typer(snapshots_app, name="snapshots")
app.add_typer(e2b_app, name="e2b")


Database = Annotated[
    str | None,
    typer.Option(
        "--database", help="PostgreSQL URL (default PAL_DATABASE_URL; unset: SQLite in the data dir)"
    ),
]


def _accel(settings: Any, accel: str | None) -> None:
    if accel is not None:
        if accel not in ("auto", "kvm", "tcg"):
            raise typer.BadParameter("--accel must be auto, kvm or tcg")
        settings.accel = accel


@data_dir_app.command("umount")
def data_dir_umount(data_dir: DataDir = None) -> None:
    """Unmount the reflink XFS image Pal loop-mounted on the data dir (stop `pal up` first).

    `pal up` and `pal image build` mount it again when needed; the image file is kept.
    """
    from pal.errors import PalError
    from pal.vmm.datadir import umount_reflink_datadir

    try:
        umount_reflink_datadir(server_settings(data_dir), say)
    except PalError as exc:
        from .output import fail

        fail(exc.message, exc.code)


@app.callback()
def main(
    json_errors: Annotated[
        bool, typer.Option("--json", help="errors as JSON on stderr, for scripts (results are JSON already)")
    ] = False,
) -> None:
    """Pal: self-hostable microVM sandboxes for AI agents.

    `pal up` runs everything on this machine; `pal vm ...` and `pal files ...` talk to it
    over HTTP (PAL_URL, default http://127.0.0.1:8080, and PAL_API_KEY).
    """
    mode.json_errors = json_errors


PortsPort = Annotated[
    int | None,
    typer.Option(
        "--ports-port",
        help="port of the ports listener: VM ports at http://PORT-VM.localhost:PORTS_PORT "
        "(default PAL_PORTS_PORT or 8082)",
    ),
]


def _ports_port(settings: Any, ports_port: int | None) -> None:
    if ports_port is not None:
        if not 1 <= ports_port <= 65535:
            raise typer.BadParameter(f"--ports-port must be 1-65535, got {ports_port}")
        settings.ports_port = ports_port


@app.command()
def up(
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    data_dir: DataDir = None,
    accel: Annotated[str | None, typer.Option(help="auto | kvm | tcg (default PAL_ACCEL or auto)")] = None,
    database: Database = None,
    ports_port: PortsPort = None,
) -> None:
    """Run the server, runtime manager and store on this machine (until SIGTERM/Ctrl-C)."""
    settings = server_settings(data_dir)
    _ports_port(settings, ports_port)
    _accel(settings, accel)
    if database:
        settings.database_url = database
    from pal import server

    server.run(settings, host, port)


@app.command()
def server(
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    database: Database = None,
    advertise_url: Annotated[
        str | None, typer.Option(help="URL other replicas reach this one at (default http://HOST:PORT)")
    ] = None,
    ports_port: PortsPort = None,
) -> None:
    """Run a control-plane replica: API, scheduler, operator routes (nodes run `pal node`).

    Several replicas share one PostgreSQL; one leads, the others forward to it."""
    settings = server_settings(None)
    _ports_port(settings, ports_port)
    if database:
        settings.database_url = database
    if not settings.database_url:
        raise typer.BadParameter(
            "pal server needs PostgreSQL: --database or PAL_DATABASE_URL (pal up embeds SQLite)"
        )
    from pal import server as server_mod

    try:
        advertise_url = server_mod.advertised_url(host, port, advertise_url)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    server_mod.run_control_plane(settings, host, port, advertise_url)


@app.command()
def doctor(
    data_dir: DataDir = None,
    url: Annotated[
        str | None, typer.Option(help="server to check (default PAL_URL or http://127.0.0.1:8080)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="the checks as JSON")] = False,
) -> None:
    """Check this host and a running Pal; exits 1 only when VMs cannot start.

    One line per host capability (used; missing, with what it costs and the fix; off, with
    what that loses), then the image, store, server, runtime manager and pool. With a server
    up (and the operator's token: root on its host, or PAL_ADMIN_TOKEN) the host lines and
    settings are the ones the server runs with."""
    import logging

    from pal.ops import doctor as doc

    # The first KVM probe boots a tiny VM (up to a few seconds): say so while it runs.
    logging.basicConfig(level=logging.WARNING, format="pal: %(message)s")
    logging.getLogger("pal.vmm.accel").setLevel(logging.INFO)
    from pal.sdk._wire import resolve

    checks = doc.run(server_settings(data_dir), resolve(url, None)[0])
    if as_json:
        print_json([c.as_json() for c in checks])
    else:
        marks = {True: "ok", False: "FAIL", None: "-"}
        print_table(
            [{"check": c.name, "": marks[c.ok], "detail": c.detail} for c in checks], ["check", "", "detail"]
        )
    if any(c.ok is False for c in checks):
        raise typer.Exit(1)


@app.command(
    epilog=cli_help.examples(
        "PAL_URL=http://127.0.0.1:8080 PAL_API_KEY=... pal mcp   # what a desktop client runs",
    )
)
def mcp(
    url: Annotated[
        str | None, typer.Option(help="Pal server (default PAL_URL or http://127.0.0.1:8080)")
    ] = None,
) -> None:
    """Serve Pal's sandbox tools to an MCP client over stdio (docs/agents.md).

    Started by the client (Claude Desktop, an agent framework) as a subprocess; every tool
    call goes to the Pal server at PAL_URL with PAL_API_KEY. The server also serves the same
    tools at /mcp (Streamable HTTP, the key as a bearer token)."""
    from pal.mcp.stdio import run_stdio

    run_stdio(url)


def _store_settings(data_dir: Path | None, database: str | None) -> Any:
    settings = server_settings(data_dir)
    if database:
        settings.database_url = database
    return settings


def _gib(n: int | None) -> float | None:
    return n / (1 << 30) if n is not None else None


def _tenant_json(t: Any) -> dict[str, Any]:
    return {
        "id": t.id,
        "name": t.name,
        "maxVms": t.max_vms,
        "maxPaused": t.max_paused,
        "maxSnapshotGib": _gib(t.max_snapshot_bytes),
        "maxVolumes": t.max_volumes,
        "maxVolumeGib": _gib(t.max_volume_bytes),
        "volumes": t.volumes_used,
        "volumeGib": _gib(t.volume_bytes_used),
        "keyExpiresAt": t.api_key_expires_at.isoformat() if t.api_key_expires_at else None,
        "deleting": t.deleting_at is not None,
        "createdAt": t.created_at.isoformat(),
    }


def _limit(value: str | None, what: str, scale: float = 1) -> int | None:
    """A limit option: a number, or `none` for no limit."""
    if value is None or value.lower() == "none":
        return None
    try:
        n = float(value)
    except ValueError:
        raise typer.BadParameter(f"{what} must be a number or 'none'") from None
    if n < 0:
        raise typer.BadParameter(f"{what} must be 0 or more")
    return int(n * scale)


MaxPaused = Annotated[str | None, typer.Option("--max-paused", help="paused VMs at once (none: no limit)")]
MaxSnapshotGib = Annotated[
    str | None, typer.Option("--max-snapshot-gib", help="GiB of snapshots kept (none: no limit)")
]
MaxVolumes = Annotated[str | None, typer.Option("--max-volumes", help="volumes at once (none: no limit)")]
MaxVolumeGib = Annotated[
    str | None, typer.Option("--max-volume-gib", help="GiB of volumes, by their sizes (none: no limit)")
]
KeyTtlDays = Annotated[
    float | None, typer.Option("--key-ttl-days", help="the API key expires after this many days")
]


def _with_store(data_dir: Path | None, database: str | None, fn: Any) -> Any:
    """Run ``fn(store)``; a PalError becomes a clear CLI failure."""
    from pal.errors import PalError
    from pal.store import Store

    settings = _store_settings(data_dir, database)
    if not settings.database_url and not settings.db_path.exists():
        # Not a data dir a server has used (a typo, PAL_DATA_DIR not exported in this shell,
        # or its XFS image not mounted yet): a new store here would be one no server reads.
        fail(
            f"no Pal store in {settings.data_dir} ({settings.db_path.name} is missing): give the data "
            f"dir your server uses (--data-dir or PAL_DATA_DIR), after starting `pal up` there once",
            "NOT_FOUND",
        )
    store = Store.open(settings)
    try:
        return fn(store)
    except PalError as exc:
        fail(exc.message, exc.code)
    finally:
        store.close()


def _find_tenant(store: Any, name_or_id: str) -> Any:
    from pal.errors import NotFound

    t = store.get_tenant(name_or_id) or store.tenant_by_name(name_or_id)
    if t is None:
        raise NotFound(f"no tenant {name_or_id!r}")
    return t


@tenants_app.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument(help="tenant name (unique)")],
    max_vms: Annotated[int, typer.Option("--max-vms", help="concurrent VM quota")] = 10,
    max_paused: MaxPaused = None,
    max_snapshot_gib: MaxSnapshotGib = None,
    max_volumes: MaxVolumes = None,
    max_volume_gib: MaxVolumeGib = None,
    key_ttl_days: KeyTtlDays = None,
    data_dir: DataDir = None,
    database: Database = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the API key")] = False,
    exist_ok: Annotated[
        bool,
        typer.Option(
            "--exist-ok",
            help="a tenant of that name gets a new key (its old one is refused at once) and these limits",
        ),
    ] = False,
) -> None:
    """Create a tenant and print its API key (shown only once: only a hash is kept).

    With --exist-ok a script that creates its tenant can run again: the tenant it made the
    first time gets a new key instead of an error."""
    from datetime import timedelta

    ttl = timedelta(days=key_ttl_days) if key_ttl_days is not None else None
    limits = {
        "max_paused": _limit(max_paused, "--max-paused"),
        "max_snapshot_bytes": _limit(max_snapshot_gib, "--max-snapshot-gib", 1 << 30),
        "max_volumes": _limit(max_volumes, "--max-volumes"),
        "max_volume_bytes": _limit(max_volume_gib, "--max-volume-gib", 1 << 30),
    }

    def create(store: Any) -> tuple[Any, str]:
        found = store.tenant_by_name(name) if exist_ok else None
        if found is None or found.deleting_at is not None:
            return store.create_tenant(name, max_vms, key_ttl=ttl, **limits)  # type: ignore[no-any-return]
        key = store.rotate_api_key(found.id, grace=timedelta(0), key_ttl=ttl)
        given = {k: v for k, v in limits.items() if v is not None}
        return store.set_tenant_limits(found.id, max_vms=max_vms, **given), key

    tenant, key = _with_store(data_dir, database, create)
    if quiet:
        typer.echo(key)
    else:
        print_json({**_tenant_json(tenant), "apiKey": key})


@tenants_app.command("set")
def tenants_set(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    max_vms: Annotated[int | None, typer.Option("--max-vms", help="concurrent VM quota")] = None,
    max_paused: MaxPaused = None,
    max_snapshot_gib: MaxSnapshotGib = None,
    max_volumes: MaxVolumes = None,
    max_volume_gib: MaxVolumeGib = None,
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Change a tenant's limits (options not given stay as they are).

    A lower limit applies to what comes next: nothing running is stopped."""
    changes: dict[str, Any] = {}
    if max_vms is not None:
        changes["max_vms"] = max_vms
    if max_paused is not None:
        changes["max_paused"] = _limit(max_paused, "--max-paused")
    if max_snapshot_gib is not None:
        changes["max_snapshot_bytes"] = _limit(max_snapshot_gib, "--max-snapshot-gib", 1 << 30)
    if max_volumes is not None:
        changes["max_volumes"] = _limit(max_volumes, "--max-volumes")
    if max_volume_gib is not None:
        changes["max_volume_bytes"] = _limit(max_volume_gib, "--max-volume-gib", 1 << 30)
    updated = _with_store(
        data_dir, database, lambda store: store.set_tenant_limits(_find_tenant(store, tenant).id, **changes)
    )
    print_json(_tenant_json(updated))


@tenants_app.command("rotate-key")
def tenants_rotate_key(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    grace_secs: Annotated[
        float, typer.Option("--grace-secs", help="the old key keeps working this long (0: refused at once)")
    ] = 0,
    key_ttl_days: KeyTtlDays = None,
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Give the tenant a new API key (printed once); the old one stops working after the grace."""
    from datetime import timedelta

    ttl = timedelta(days=key_ttl_days) if key_ttl_days is not None else None

    def rotate(store: Any) -> tuple[Any, str]:
        t = _find_tenant(store, tenant)
        key = store.rotate_api_key(t.id, grace=timedelta(seconds=grace_secs), key_ttl=ttl)
        return store.get_tenant(t.id), key

    t, key = _with_store(data_dir, database, rotate)
    print_json({**_tenant_json(t), "apiKey": key})


@tenants_app.command("rm")
def tenants_rm(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Remove a tenant: its keys are refused at once, then its VMs, snapshots and volumes go.

    The server (its leader) deletes the tenant's VMs and their snapshots, locally and in S3,
    its volumes with their files, and finally the tenant."""
    t = _with_store(
        data_dir, database, lambda store: store.mark_tenant_deleting(_find_tenant(store, tenant).id)
    )
    note = "keys refused now; the server deletes its VMs, snapshots and volumes"
    print_json({**_tenant_json(t), "note": note})


TENANT_COLUMNS = [
    "id",
    "name",
    "maxVms",
    "maxPaused",
    "maxSnapshotGib",
    "maxVolumes",
    "maxVolumeGib",
    "keyExpiresAt",
    "createdAt",
]


@tenants_app.command("ls")
def tenants_ls(
    data_dir: DataDir = None,
    table: Table = False,
    database: Database = None,
) -> None:
    """List tenants (never their keys)."""
    rows = _with_store(data_dir, database, lambda store: [_tenant_json(t) for t in store.list_tenants()])
    print_rows(rows, TENANT_COLUMNS, table)


tenant_keys_app = typer.Typer(
    help="A tenant's E2B keys (e2b_...): for E2B's SDKs on /e2b (docs/e2b.md), revocable one by one.",
    no_args_is_help=True,
)
tenants_app.add_typer(tenant_keys_app, name="keys")


@tenant_keys_app.command("add")
def tenant_keys_add(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    name: Annotated[str, typer.Option("--name", help="what the key is for")] = "",
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Make an E2B key of the tenant's and print it (shown once: only its hash is kept)."""
    from pal.e2b.keys import new_key
    from pal.store import e2b_keys

    key = new_key()
    made = _with_store(
        data_dir, database, lambda store: e2b_keys.add_key(store, _find_tenant(store, tenant).id, key, name)
    )
    print_json({"id": made.key_id, "tenantId": made.tenant_id, "name": made.name, "apiKey": key})


@tenant_keys_app.command("ls")
def tenant_keys_ls(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    data_dir: DataDir = None,
    database: Database = None,
    table: Table = False,
) -> None:
    """The tenant's E2B keys (their ids and masks, never the keys)."""
    from pal.store import e2b_keys

    rows = _with_store(
        data_dir, database, lambda store: e2b_keys.list_keys(store, _find_tenant(store, tenant).id)
    )
    out = [
        {"id": k.key_id, "name": k.name, "mask": k.mask, "createdAt": k.created_at.isoformat()} for k in rows
    ]
    print_rows(out, ["id", "name", "mask", "createdAt"], table)


@tenant_keys_app.command("revoke")
def tenant_keys_revoke(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    key_id: Annotated[str, typer.Argument(help="the key's id (`pal tenants keys ls`)")],
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Revoke one of the tenant's E2B keys: refused from the next request on."""
    from pal.errors import NotFound
    from pal.store import e2b_keys

    def revoke(store: Any) -> None:
        if not e2b_keys.revoke_key(store, _find_tenant(store, tenant).id, key_id):
            raise NotFound(f"the tenant has no E2B key {key_id!r}")

    _with_store(data_dir, database, revoke)
    print_json({"id": key_id, "revoked": True})


if __name__ == "__main__":
    app()
