"""`pal vm snapshot/snapshots/snapshot-rm/start-snapshot`: the tenant's kept snapshots
(docs/lifecycle.md, "Kept snapshots"), through the SDK. Not `pal snapshots`: that is the
operator's S3 commands, run on the server's machine."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .help import examples
from .output import Table, call, parse_pairs, print_json, print_rows
from .vm import Meta, Quiet, Secret, VmId, client, vm_app

KEPT_COLUMNS = ["snapshotId", "name", "sourceVmId", "createdAt"]
Snapshot = Annotated[str, typer.Argument(metavar="SNAPSHOT", help="a kept snapshot's id (snap-...) or name")]
QuietSnapshot = Annotated[bool, typer.Option("--quiet", "-q", help="print only the snapshot id")]


@vm_app.command(
    "snapshot",
    epilog=examples(
        "pal vm snapshot $VM --name golden",
        "VM2=$(pal vm start-snapshot golden -q)",
    ),
)
def snapshot(
    vm_id: VmId,
    name: Annotated[
        str | None,
        typer.Option("--name", help="1-100 of A-Z a-z 0-9 . _ - (held by another: it moves to this one)"),
    ] = None,
    quiet: QuietSnapshot = False,
) -> None:
    """Keep a snapshot of a VM to start new VMs from; the VM runs on (or stays paused).

    A kept snapshot is out of the VM's retention and outlives its delete."""
    kept = call(lambda: client().runtime.keep_snapshot(vm_id, name))
    if quiet:
        typer.echo(kept["snapshotId"])
    else:
        print_json(kept)


@vm_app.command("snapshots")
def snapshots(
    vm: Annotated[str | None, typer.Option("--vm", metavar="VM", help="only those of this VM")] = None,
    name: Annotated[str | None, typer.Option("--name", help="only the one of this name (or id)")] = None,
    table: Table = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the snapshot ids")] = False,
) -> None:
    """List your kept snapshots, oldest first, every page."""
    found = call(lambda: client().runtime.kept_snapshots(vm_id=vm, name=name))
    if quiet:
        for k in found:
            typer.echo(k["snapshotId"])
    else:
        print_rows(found, KEPT_COLUMNS, table)


@vm_app.command("snapshot-rm")
def snapshot_rm(snapshot: Snapshot) -> None:
    """Let a kept snapshot go; the VMs started from it run on.

    Its files go too, once its VM no longer needs them."""
    print_json(call(lambda: client().runtime.delete_kept_snapshot(snapshot)))


@vm_app.command(
    "start-snapshot",
    epilog=examples(
        "pal vm start-snapshot golden -n 3",
        "pal vm start-snapshot golden --meta run=42 --secret SEED=7 -q",
    ),
)
def start_snapshot(
    snapshot: Snapshot,
    n: Annotated[int, typer.Option("-n", "--count", help="number of VMs")] = 1,
    meta: Meta = None,
    secret: Secret = None,
    quiet: Quiet = False,
) -> None:
    """N new VMs from a kept snapshot: its memory, disk and running processes.

    Each has its own id and identity and the source's settings. --meta K=V tags them
    instead of the source's tags (repeat it; without it: the source's); --secret K=V sets
    an env var over the source's in each."""
    tags = parse_pairs(meta, "--meta") if meta else None
    secrets = parse_pairs(secret, "--secret") if secret else None
    res: dict[str, Any] = call(
        lambda: client().runtime.start_from_snapshot(snapshot, n, metadata=tags, secrets=secrets)
    )
    if not quiet:
        print_json(res)
        return
    for child in res["forks"]:
        typer.echo(child["vmId"])
    if any(child.get("error") for child in res["forks"]):
        raise typer.Exit(1)
