"""`pal volumes put|get|cat|ls-files|stat|mkdir|rm-file`: a volume's files without a
sandbox (docs/volumes.md, "Files"), in the shapes of `pal files` (a VM's files)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pal.guest.protocol import MAX_FILE_BYTES

from .output import Table, call, fail, note, print_json, print_table, read_local
from .volumes import Volume, client, volumes_app

FILE_LIMIT = f"{MAX_FILE_BYTES >> 20} MiB"  # the files API limit, in words
LocalOut = Annotated[Path | None, typer.Argument(help="local file to write; stdout when omitted or -")]
InVolume = Annotated[str, typer.Argument(metavar="PATH", help="path in the volume, from its root")]


@volumes_app.command("ls-files")
def ls_files(
    volume: Volume,
    path: Annotated[str, typer.Argument(metavar="PATH", help="directory in the volume")] = "",
    depth: Annotated[int, typer.Option("--depth", min=1, max=16, help="levels down")] = 1,
    table: Table = False,
) -> None:
    """List a directory of a volume (default its root); symlinks are shown, not followed."""
    res = call(lambda: client().volumes.list_files(volume, path, depth=depth))
    if table:
        print_table(res["entries"], ["path", "type", "size", "modifiedAt"])
    else:
        print_json(res)
    if res["truncated"]:
        note("truncated at 1000 entries")


@volumes_app.command("stat")
def stat(volume: Volume, path: InVolume) -> None:
    """What is at PATH (exit status 1 with FILE_NOT_FOUND when nothing is)."""
    print_json(call(lambda: client().volumes.stat(volume, path)))


@volumes_app.command("cat")
def cat(volume: Volume, path: InVolume) -> None:
    """Write a file's bytes to stdout, exactly (cut at 1 MiB; a note on stderr says so)."""
    data = call(lambda: client().volumes.read_file_bytes(volume, path))
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
    if data.truncated:
        note(f"truncated at {FILE_LIMIT} (the files API limit)")


@volumes_app.command("get")
def get(
    volume: Volume,
    path: Annotated[str | None, typer.Argument(metavar="[PATH]", help="a file to copy out")] = None,
    local: Annotated[
        Path | None, typer.Argument(help="local file to write; stdout when omitted or -")
    ] = None,
) -> None:
    """Show a volume and the VMs that mount it; with PATH, copy that file out instead.

    A file is copied byte for byte; one cut at 1 MiB exits with status 1."""
    if path is None:
        print_json(call(lambda: client().volumes.get(volume)))
        return
    data = call(lambda: client().volumes.read_file_bytes(volume, path))
    if local is None or str(local) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        local.write_bytes(data)
    if data.truncated:
        fail(f"{path} is larger than {FILE_LIMIT}: only its first {FILE_LIMIT} was copied", "TRUNCATED")


@volumes_app.command("put")
def put(
    volume: Volume,
    path: Annotated[str, typer.Argument(metavar="PATH", help="path in the volume (parents are made)")],
    local: Annotated[Path | None, typer.Argument(help="local file; stdin when omitted or -")] = None,
) -> None:
    """Write a file into a volume from a local file or stdin, byte for byte (at most 1 MiB)."""
    data = read_local(local)
    print_json(call(lambda: client().volumes.write_file(volume, path, data)))


@volumes_app.command("mkdir")
def mkdir(
    volume: Volume,
    path: InVolume,
    parents: Annotated[
        bool, typer.Option("--parents", "-p", help="make missing parents; no error if it exists")
    ] = False,
) -> None:
    """Make a directory in a volume."""
    print_json(call(lambda: client().volumes.make_dir(volume, path, parents=parents)))


@volumes_app.command("rm-file")
def rm_file(
    volume: Volume,
    path: InVolume,
    recursive: Annotated[bool, typer.Option("--recursive", "-r", help="a directory and all in it")] = False,
) -> None:
    """Remove a file or symlink of a volume (a directory with --recursive)."""
    print_json(call(lambda: client().volumes.delete_file(volume, path, recursive=recursive)))
