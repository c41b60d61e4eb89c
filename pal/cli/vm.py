"""`pal vm ...` and `pal files ...`: sandbox commands, all through the SDK (PAL_URL, PAL_API_KEY)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pal.sdk import Client

from .output import api_errors, call, parse_pairs, print_json, print_table

vm_app = typer.Typer(help="Schedule, inspect, pause, resume, fork, exec in VMs.", no_args_is_help=True)
files_app = typer.Typer(help="Files under a VM's /workspace (text, at most 1 MiB).", no_args_is_help=True)

VM_COLUMNS = ["vmId", "state", "image", "createdAt", "snapshotId", "parentVmId", "reason"]


def client() -> Client:
    return Client()


VmId = Annotated[str, typer.Argument(help="VM id")]


@vm_app.command("schedule")
def schedule(
    image: Annotated[str, typer.Option(help="guest image name")] = "default",
    vcpus: Annotated[int | None, typer.Option(help="virtual CPUs")] = None,
    memory_mib: Annotated[int | None, typer.Option(help="guest RAM in MiB")] = None,
    disk_mib: Annotated[int | None, typer.Option(help="root disk in MiB")] = None,
    idle_timeout: Annotated[int, typer.Option(help="suspend after N idle seconds (0 = never)")] = 0,
    secret: Annotated[list[str] | None, typer.Option(help="K=V env var for every exec (repeatable)")] = None,
    cold: Annotated[bool, typer.Option(help="cold boot instead of a warm template")] = False,
) -> None:
    """Start a sandbox microVM; prints its JSON (with vmId)."""
    given = {"vcpus": vcpus, "memoryMib": memory_mib, "diskMib": disk_mib}
    limits = {k: v for k, v in given.items() if v is not None}
    spec: dict[str, object] = {"image": image, "idleTimeoutSecs": idle_timeout}
    if limits:
        spec["limits"] = limits
    if secret:
        spec["secrets"] = parse_pairs(secret, "--secret")
    if cold:
        spec["boot"] = "cold"
    print_json(call(lambda: client().runtime.schedule(**spec)))


@vm_app.command("ls")
def ls(table: Annotated[bool, typer.Option("--table", help="rich table instead of JSON")] = False) -> None:
    """List your VMs."""
    vms = call(lambda: client().runtime.list())
    if table:
        print_table(vms, VM_COLUMNS, title="VMs")
    else:
        print_json(vms)


@vm_app.command("get")
def get(vm_id: VmId) -> None:
    print_json(call(lambda: client().runtime.get(vm_id)))


@vm_app.command("rm")
def rm(vm_id: VmId) -> None:
    """Stop a VM (-> terminated)."""
    print_json(call(lambda: client().runtime.delete(vm_id)))


@vm_app.command("pause")
def pause(vm_id: VmId) -> None:
    """Snapshot and stop a running VM; frees its quota slot."""
    print_json(call(lambda: client().runtime.pause(vm_id)))


@vm_app.command("resume")
def resume(vm_id: VmId) -> None:
    print_json(call(lambda: client().runtime.resume(vm_id)))


@vm_app.command("fork")
def fork(vm_id: VmId, n: Annotated[int, typer.Option("-n", "--count", help="number of forks")] = 1) -> None:
    """N copy-on-write copies of a running VM."""
    print_json(call(lambda: client().runtime.fork(vm_id, count=n)))


@vm_app.command("events")
def events(vm_id: VmId) -> None:
    """Status and audit events (transitions, auto_resume)."""
    print_json(call(lambda: client().runtime.events(vm_id)))


@vm_app.command("exec")
def exec_(
    vm_id: VmId,
    command: Annotated[list[str], typer.Argument(help="executable and its arguments (after --)")],
    stream: Annotated[bool, typer.Option(help="print output as it comes (SSE)")] = False,
    env: Annotated[list[str] | None, typer.Option(help="K=V (repeatable)")] = None,
    cwd: Annotated[str | None, typer.Option(help="working directory (default /workspace)")] = None,
    timeout: Annotated[float | None, typer.Option(help="kill the command after N seconds")] = None,
) -> None:
    """Run a command execve-style; exits with the command's exit status."""
    exe, args = command[0], command[1:]
    envs = parse_pairs(env, "--env")
    rt = client().runtime
    with api_errors():
        if not stream:
            res = rt.exec(vm_id, exe, args, env=envs, cwd=cwd, timeout_secs=timeout)
            sys.stdout.write(res.stdout)
            sys.stderr.write(res.stderr)
            raise typer.Exit(res.exit_code)
        for ev in rt.exec_stream(vm_id, exe, args, env=envs, cwd=cwd, timeout_secs=timeout):
            if ev.type == "stdout":
                sys.stdout.write(ev.data or "")
                sys.stdout.flush()
            elif ev.type == "stderr":
                sys.stderr.write(ev.data or "")
                sys.stderr.flush()
            elif ev.type == "exit":
                raise typer.Exit(ev.exit_code if ev.exit_code is not None else 1)
            else:
                sys.stderr.write(f"error: {ev.code}: {ev.message}\n")
                raise typer.Exit(1)
        raise typer.Exit(1)  # stream ended without an exit event


@files_app.command("ls")
def files_ls(
    vm_id: VmId,
    path: Annotated[str, typer.Argument(help="directory under /workspace")] = "",
    table: Annotated[bool, typer.Option("--table")] = False,
) -> None:
    res = call(lambda: client().runtime.list_files(vm_id, path))
    if table:
        print_table(res["entries"], ["name", "type", "size"], title=res["path"] or "/workspace")
    else:
        print_json(res)


@files_app.command("cat")
def files_cat(vm_id: VmId, path: str) -> None:
    """Print a file (cut at 1 MiB; a note on stderr says so)."""
    text = call(lambda: client().runtime.read_file(vm_id, path))
    sys.stdout.write(text)
    if text.truncated:
        sys.stderr.write("\n[pal: truncated at 1 MiB]\n")


@files_app.command("put")
def files_put(
    vm_id: VmId,
    path: str,
    local: Annotated[Path | None, typer.Argument(help="local file; stdin when omitted")] = None,
) -> None:
    """Write a file from a local file or stdin."""
    data = local.read_bytes() if local is not None else sys.stdin.buffer.read()
    print_json(call(lambda: client().runtime.write_file(vm_id, path, data)))
