"""`pal image ...`: build, import, export, list and remove guest images (operator commands).

They work on the data dir directly (as root, like `pal tenants`), so they also work with
no server running; `--warm` asks a running server on that data dir to build the image's
template at once. Server-side modules are imported lazily.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from .output import Table, err_console, fail, parse_pairs, print_json, print_rows
from .settings import prepare_data_dir, server_settings

image_app = typer.Typer(
    help="Guest images: Pal's Debian default, imported container images, Dockerfile builds.",
    no_args_is_help=True,
)

DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="data directory (default PAL_DATA_DIR or /var/lib/pal)")
]
Warm = Annotated[bool, typer.Option(help="build the image's warm template now (needs a running server)")]
Tenants = Annotated[
    list[str] | None,
    typer.Option("--tenant", help="only this tenant may use the image (name or id; repeatable)"),
]
LS_COLUMNS = ["name", "kind", "digest", "sourceDigest", "size", "createdAt", "templates", "vms", "tenants"]


def _pal_errors(fn: Any) -> Any:
    from pal.errors import PalError

    try:
        return fn()
    except PalError as exc:
        fail(exc.message, exc.code)


def _with_progress(name: str, fn: Any) -> Any:
    """``fn(progress)`` under a progress bar; a failure is reported once the bar is closed
    (the error is the last thing on stderr)."""
    return _pal_errors(lambda: _run_progress(name, fn))


def _run_progress(name: str, fn: Any) -> Any:
    from pal.ops.progress import Steps

    with Steps(f"image {name}", err_console) as progress:  # stderr: stdout stays JSON
        result = fn(progress)
        progress("done", 1.0)
    return result


def _tenant_ids(settings: Any, names: list[str]) -> list[str]:
    from pal.store import Store

    store = Store.open(settings)
    try:
        known = {t.name: t.id for t in store.list_tenants()}
    finally:
        store.close()
    ids = []
    for n in names:
        if n in known.values():
            ids.append(n)
        elif n in known:
            ids.append(known[n])
        else:
            fail(f"no tenant named {n!r} (see `pal tenants ls`)", "NOT_FOUND")
    return ids


def _set_tenants(settings: Any, name: str, tenants: list[str] | None) -> None:
    from pal.images.paths import image_dir, read_meta, write_meta

    d = image_dir(settings, name)
    meta = read_meta(d)
    if meta is None:
        fail(f"unknown image {name!r}", "IMAGE_NOT_FOUND")
        return
    meta["tenants"] = _tenant_ids(settings, tenants) if tenants else None
    write_meta(d, meta)


def _tenants_of(settings: Any, tenants: list[str] | None) -> list[str] | None:
    """``--tenant`` as ids, resolved before any build or import: an unknown name fails
    with nothing changed, and the ids go into the image's meta before it is published."""
    return _tenant_ids(settings, tenants) if tenants else None


def _warm(settings: Any, name: str) -> None:
    """Ask the server running on this data dir to build the default size's template.

    ``--warm`` was asked for, so a template that is not built is a failure (exit 1), said
    once: the image itself is installed, and its template is built on first schedule."""
    from pal.errors import PalError
    from pal.scheduler.node_client import HttpNode
    from pal.spec import Limits
    from pal.wire import verbs
    from pal.wire.models import WarmRequest

    def no_template(why: str, code: str) -> NoReturn:
        fail(
            f"image {name} is installed, but --warm built no template: {why}; "
            "the template is built on the first schedule instead",
            code,
        )

    if not settings.manager_socket.exists():
        no_template(f"no server is running on {settings.data_dir}", "UNAVAILABLE")
    size = Limits.model_validate({})
    req = WarmRequest(image=name, memory_mib=size.memory_mib, vcpus=size.vcpus, disk_mib=size.disk_mib)

    async def go() -> Any:
        client = HttpNode(settings.manager_socket)
        try:
            return await client.call(verbs.WARM, req)
        finally:
            await client.aclose()

    from pal.ops.progress import Steps

    title = f"template of {name} ({size.memory_mib} MiB, {size.vcpus} vCPU)"
    try:
        with Steps(title, err_console) as steps:  # the server builds it: boot, ready, snapshot
            steps("booting a VM of the image and snapshotting it (on the server)", 0.1)
            res = asyncio.run(go())
    except PalError as exc:
        no_template(exc.message, exc.code)
    if not res.ready:
        no_template(f"building template {res.key} failed (see the server log)", "TEMPLATE_FAILED")
    err_console.print(f"template {res.key}: ready")


def _drop_old_templates(settings: Any, old_digest: str | None) -> None:
    from pal.server import drop_unused_templates

    drop_unused_templates(settings, old_digest)


def _old_digest(settings: Any, name: str) -> str | None:
    from pal.images.paths import ImageNotFound, load_image

    try:
        return str(load_image(settings, name).agent_version_id)
    except ImageNotFound:
        return None


def _installed(settings: Any, name: str, result: Any, old_digest: str | None, warm: bool) -> None:
    """After a build or import: the replaced build's templates gone, its summary printed,
    and (``--warm``) its template made now."""
    _drop_old_templates(settings, old_digest)
    print_json(_summary(result))
    if warm:
        _warm(settings, name)


def _summary(image: Any) -> dict[str, Any]:
    m = image.meta
    return {
        "name": image.name,
        "digest": image.agent_version_id,
        "kind": m.get("kind"),
        "source": m.get("source"),
        "sourceDigest": m.get("sourceDigest"),
        "config": m.get("config"),
        "rootfsBytes": m.get("rootfsBytes"),
        "treeBytes": m.get("treeBytes"),
        "buildSeconds": m.get("buildSeconds"),
    }


@image_app.command("build")
def image_build(
    name: Annotated[str | None, typer.Argument(help="image name (default: `default`, without -f)")] = None,
    file: Annotated[
        Path | None, typer.Option("-f", "--file", help="a Dockerfile (built with buildah); else Debian")
    ] = None,
    context: Annotated[
        Path | None, typer.Argument(help="build context (default: the Dockerfile's directory)")
    ] = None,
    build_arg: Annotated[list[str] | None, typer.Option(help="K=V build argument (repeatable)")] = None,
    force: Annotated[bool, typer.Option(help="rebuild the Debian image even if it is current")] = False,
    warm: Warm = False,
    tenant: Tenants = None,
    data_dir: DataDir = None,
) -> None:
    """Build an image: from a Dockerfile (-f), Pal's recipe (code-interpreter), or Debian.

    `code-interpreter` is Pal's recipe: Jupyter, numpy, pandas and matplotlib over the
    default image (docs/agents.md)."""
    from pal.images import build_image
    from pal.images.dockerfile import build_dockerfile
    from pal.images.recipes import build_recipe, recipe

    settings = server_settings(data_dir)
    prepare_data_dir(settings)  # images, VM disks and snapshots share a reflink file system
    if file is None and context is not None:
        raise typer.BadParameter("a build context needs a Dockerfile (-f)")
    if name is None and file is not None:
        raise typer.BadParameter("name the image a Dockerfile builds: pal image build NAME -f Dockerfile")
    name = name or "default"
    tenants = _tenants_of(settings, tenant)
    old = _old_digest(settings, name)
    if file is not None:
        args = parse_pairs(build_arg, "--build-arg")
        result = _with_progress(
            name,
            lambda progress: build_dockerfile(
                settings, name, file, context, progress, progress.log, args, tenants=tenants
            ),
        )
    elif recipe(name) is not None:  # Pal's own recipe (code-interpreter): FROM the default image
        result = _with_progress(
            name,
            lambda progress: build_recipe(
                settings, name, progress=progress, force=force, tenants=tenants, log=progress.log
            ),
        )
    else:
        result = _with_progress(
            name,
            lambda progress: build_image(settings, name, progress=progress, force=force, tenants=tenants),
        )
    _installed(settings, name, result, old, warm)


@image_app.command("import")
def image_import(
    name: Annotated[str, typer.Argument(help="image name (what `image` in a schedule request names)")],
    source: Annotated[
        str,
        typer.Argument(
            help="docker-archive or OCI archive file, OCI layout dir, or registry reference "
            "(docker.io/library/alpine:3.20); skopeo transports (oci:, docker://...) also work"
        ),
    ],
    warm: Warm = False,
    tenant: Tenants = None,
    data_dir: DataDir = None,
) -> None:
    """Import a container image (Docker/OCI archive, OCI layout, registry) as a Pal image."""
    from pal.images.importer import import_image

    settings = server_settings(data_dir)
    prepare_data_dir(settings)
    tenants = _tenants_of(settings, tenant)
    old = _old_digest(settings, name)
    result = _with_progress(
        name, lambda progress: import_image(settings, name, source, progress, tenants=tenants)
    )
    _installed(settings, name, result, old, warm)


@image_app.command("export")
def image_export(
    name: Annotated[str, typer.Argument(help="image name")],
    oci: Annotated[Path, typer.Option("--oci", help="OCI layout directory to write (or add to)")],
    data_dir: DataDir = None,
) -> None:
    """Write an image as an OCI layout, so a Dockerfile can start `FROM oci:DIR:NAME`."""
    from pal.images.export import export_image

    settings = server_settings(data_dir)
    ref = _with_progress(name, lambda progress: export_image(settings, name, oci, progress))
    print_json({"name": name, "oci": str(oci.resolve()), "from": ref})


def _vms_using(settings: Any) -> dict[str, list[str]]:
    """Image name -> ids of the VMs made from it that can still run (not failed or
    terminated: a failed VM can only be deleted, so it needs nothing of its image)."""
    from pal.scheduler.states import FINAL, VmState
    from pal.store import Store

    if not settings.db_path.exists():
        return {}
    store = Store.open(settings)
    try:
        out: dict[str, list[str]] = {}
        for vm in store.list_vms():
            if vm.state not in FINAL and vm.state != VmState.FAILED:
                out.setdefault(vm.image, []).append(vm.vm_id)
        return out
    finally:
        store.close()


@image_app.command("ls")
def image_ls(
    data_dir: DataDir = None,
    table: Table = False,
) -> None:
    """List images: name, kind, digest, source digest, size, created, warm templates, VMs."""
    from pal.images.builder import is_current
    from pal.images.paths import list_images
    from pal.manager.templates import TemplateCache

    settings = server_settings(data_dir)
    templates = TemplateCache.from_settings(settings)
    using = _vms_using(settings)
    rows = []
    for img in list_images(settings):
        m = img.meta
        rows.append(
            {
                "name": img.name,
                "kind": m.get("kind", "debian"),
                "digest": img.agent_version_id,
                "source": m.get("source"),
                "sourceDigest": m.get("sourceDigest"),
                "size": m.get("treeBytes"),
                "createdAt": m.get("builtAt"),
                "templates": templates.sizes(img.agent_version_id),
                "vms": len(using.get(img.name, [])),
                "tenants": m.get("tenants"),
                "current": is_current(m),
            }
        )
    if table:
        for r in rows:
            r["digest"] = str(r["digest"])[:19]
            r["sourceDigest"] = (r["sourceDigest"] or "")[:19]
            r["size"] = f"{(r['size'] or 0) / 1024**2:.0f} MiB"
            r["templates"] = " ".join(r["templates"])
            r["tenants"] = "all" if r["tenants"] is None else ",".join(r["tenants"])
    print_rows(rows, LS_COLUMNS, table)


@image_app.command("rm")
def image_rm(
    name: Annotated[str, typer.Argument(help="image name")],
    force: Annotated[
        bool, typer.Option(help="remove even while VMs use it (they keep running and resume)")
    ] = False,
    data_dir: DataDir = None,
) -> None:
    """Remove an image (refused while VMs or their snapshots use it, unless --force)."""
    from pal.server import remove_image

    settings = server_settings(data_dir)
    users = _vms_using(settings).get(name, [])
    if users and not force:
        shown = ", ".join(users[:5]) + (" ..." if len(users) > 5 else "")
        fail(
            f"image {name!r} is used by {len(users)} VM(s) (running or paused): {shown}; "
            "delete them first, or pass --force (they keep running, and resume from their snapshots)",
            "FAILED_PRECONDITION",
        )
    _pal_errors(lambda: remove_image(settings, name))
    print_json({"name": name, "removed": True, "vmsStillUsingIt": users})


@image_app.command("access")
def image_access(
    name: Annotated[str, typer.Argument(help="image name")],
    tenant: Tenants = None,
    all_tenants: Annotated[bool, typer.Option("--all", help="every tenant may use it")] = False,
    data_dir: DataDir = None,
) -> None:
    """Choose which tenants may use an image (default: all)."""
    if bool(tenant) == all_tenants:
        raise typer.BadParameter("give --tenant (repeatable) or --all")
    settings = server_settings(data_dir)
    _set_tenants(settings, name, None if all_tenants else tenant)
    print_json({"name": name, "tenants": "all" if all_tenants else tenant})
