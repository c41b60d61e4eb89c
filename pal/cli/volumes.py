"""`pal volumes ...`: volumes, storage that outlives a VM (docs/volumes.md), through the SDK
(PAL_URL, PAL_API_KEY)."""

from __future__ import annotations

from typing import Annotated

import typer

from pal.sdk import Client
from pal.sizes import DEFAULT_VOLUME_MIB

from .help import examples
from .output import Table, call, parse_pairs, print_json, print_rows

volumes_app = typer.Typer(
    help="Volumes: storage that outlives a VM (create, ls, get, resize, rm; and their files: "
    "put, get, cat, ls-files, stat, mkdir, rm-file).",
    no_args_is_help=True,
    epilog=examples(
        "pal volumes create cache --size-mib 4096 --meta team=ml",
        "pal volumes ls --table --meta team=ml",
        "pal volumes resize cache 8192",
        "pal volumes put cache seed/data.json ./data.json",
        "pal volumes ls-files cache seed --table",
        "pal volumes get cache results/out.json ./out.json",
        "pal volumes rm-file cache results --recursive",
        "pal volumes rm cache",
    ),
)
VOLUME_COLUMNS = ["volumeId", "name", "sizeMib", "state", "createdAt"]
Volume = Annotated[str, typer.Argument(metavar="VOLUME", help="volume id (vol-...) or name")]
Meta = Annotated[list[str] | None, typer.Option("--meta", help="K=V metadata tag (repeatable)")]


def client() -> Client:
    return Client()


@volumes_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="its name, unique among your volumes")],
    size_mib: Annotated[
        int, typer.Option("--size-mib", help="its size limit (allocated only as written)")
    ] = DEFAULT_VOLUME_MIB,
    meta: Meta = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the volume id")] = False,
) -> None:
    """Create a volume."""
    tags = parse_pairs(meta, "--meta") if meta else None
    vol = call(lambda: client().volumes.create(name, size_mib, tags))
    if quiet:
        typer.echo(vol["volumeId"])
    else:
        print_json(vol)


@volumes_app.command("ls")
def ls(table: Table = False, meta: Meta = None) -> None:
    """List your volumes, oldest first (--meta K=V keeps those tagged so; all must match)."""
    wanted = parse_pairs(meta, "--meta") if meta else None
    print_rows(call(lambda: client().volumes.list(wanted)), VOLUME_COLUMNS, table)


@volumes_app.command("resize")
def resize(
    volume: Volume,
    size_mib: Annotated[int, typer.Argument(metavar="SIZE_MIB", help="the new size (a volume only grows)")],
) -> None:
    """Grow a volume to SIZE_MIB."""
    print_json(call(lambda: client().volumes.resize(volume, size_mib)))


@volumes_app.command("rm")
def rm(
    volume: Volume,
    force: Annotated[bool, typer.Option("--force", help="delete it even while VMs mount it")] = False,
) -> None:
    """Delete a volume and its files (refused while VMs mount it, unless --force)."""
    print_json(call(lambda: client().volumes.delete(volume, force=force)))
