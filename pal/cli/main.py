"""`pal`: run the server, build images, manage tenants, and drive sandboxes from a shell.

Server-side commands (up, image, doctor, tenants) import their modules lazily so `pal vm
...` stays fast and works on a machine that has only the SDK's dependencies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from .output import err_console, print_json, print_table
from .vm import files_app, vm_app

app = typer.Typer(
    name="pal", help="Pal: self-hostable microVM sandboxes for AI agents.", no_args_is_help=True
)
image_app = typer.Typer(help="Guest images (kernel + root file system).", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants and their API keys (opens the store directly).", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(tenants_app, name="tenants")
app.add_typer(vm_app, name="vm")
app.add_typer(files_app, name="files")

DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="data directory (default PAL_DATA_DIR or /var/lib/pal)")
]


def _settings(data_dir: Path | None) -> Any:
    from pal.config import Settings

    return Settings.from_env(data_dir)


@app.command()
def up(
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    data_dir: DataDir = None,
    accel: Annotated[str | None, typer.Option(help="auto | kvm | tcg (default PAL_ACCEL or auto)")] = None,
) -> None:
    """Run the server, runtime manager and store on this machine (until SIGTERM/Ctrl-C)."""
    settings = _settings(data_dir)
    if accel is not None:
        if accel not in ("auto", "kvm", "tcg"):
            raise typer.BadParameter("--accel must be auto, kvm or tcg")
        settings.accel = accel
    from pal import server

    server.run(settings, host, port)


@image_app.command("build")
def image_build(
    name: Annotated[str, typer.Argument(help="image name")] = "default",
    data_dir: DataDir = None,
    force: Annotated[bool, typer.Option(help="rebuild even if the image exists")] = False,
) -> None:
    """Build a guest image from Debian packages (kernel, initramfs, root fs, warm template)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pal.images import build_image
    from pal.server import prepare_data_dir

    settings = _settings(data_dir)
    # Images, VM disks and snapshots must share a reflink-capable file system.
    err_console.print(f"data dir {settings.data_dir}: {prepare_data_dir(settings)}")
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(), transient=False
    ) as progress:
        task = progress.add_task(f"image {name}", total=1.0)

        def on_progress(step: str, fraction: float) -> None:
            progress.update(task, description=f"{name}: {step}", completed=max(0.0, min(1.0, fraction)))

        result = build_image(settings, name, progress=on_progress, force=force)
        progress.update(task, completed=1.0)
    if result is not None:
        print_json(_jsonable(result))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True)
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return json.loads(json.dumps(asdict(value), default=str))
    return value if isinstance(value, dict | list | str | int | float | bool) else str(value)


@app.command()
def doctor(data_dir: DataDir = None) -> None:
    """Check this host: accelerator, reflinks, image, store, manager."""
    from rich.console import Console
    from rich.table import Table

    from pal import server

    report = server.doctor(_settings(data_dir))
    table = Table(title="pal doctor")
    table.add_column("check")
    table.add_column("result")
    for key, value in report.items():
        table.add_row(str(key), value if isinstance(value, str) else json.dumps(value, default=str))
    Console().print(table)


def _tenant_json(t: Any) -> dict[str, Any]:
    return {"id": t.id, "name": t.name, "maxVms": t.max_vms, "createdAt": t.created_at.isoformat()}


@tenants_app.command("create")
def tenants_create(
    name: str,
    max_vms: Annotated[int, typer.Option("--max-vms", help="concurrent VM quota")] = 10,
    data_dir: DataDir = None,
) -> None:
    """Create a tenant and print its API key (shown only once)."""
    from pal.errors import PalError
    from pal.store import Store

    store = Store.open(_settings(data_dir))
    try:
        tenant, key = store.create_tenant(name, max_vms)
    except PalError as exc:
        from .output import fail

        fail(exc.message, exc.code)
    finally:
        store.close()
    print_json({**_tenant_json(tenant), "apiKey": key})


@tenants_app.command("ls")
def tenants_ls(data_dir: DataDir = None, table: Annotated[bool, typer.Option("--table")] = False) -> None:
    """List tenants (never their keys)."""
    from pal.store import Store

    store = Store.open(_settings(data_dir))
    try:
        rows = [_tenant_json(t) for t in store.list_tenants()]
    finally:
        store.close()
    if table:
        print_table(rows, ["id", "name", "maxVms", "createdAt"], title="tenants")
    else:
        print_json(rows)


@app.command()
def bench(
    iterations: Annotated[int, typer.Option(help="iterations per measurement (p50/p90)")] = 20,
    fork_iterations: Annotated[int, typer.Option(help="iterations of the fork fan-out runs")] = 3,
    memory_mib: Annotated[int, typer.Option(help="guest RAM of the measured VMs")] = 256,
    url: Annotated[str | None, typer.Option(help="measure a running server (with --api-key)")] = None,
    api_key: Annotated[str | None, typer.Option(help="tenant key for --url")] = None,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where runtime-latency.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Latency benchmarks (snapshot, restore, fork, first exec, stop, cold boot)."""
    from pal import bench as bench_mod

    bench_mod.main(
        iterations=iterations,
        fork_iterations=fork_iterations,
        memory_mib=memory_mib,
        url=url,
        api_key=api_key,
        data_dir=data_dir,
        out_dir=out_dir,
    )


if __name__ == "__main__":
    app()
