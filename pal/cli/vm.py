"""`pal vm ...` and `pal files ...`: sandbox commands, all through the SDK (PAL_URL, PAL_API_KEY)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from pal.guest.protocol import MAX_FILE_BYTES
from pal.sdk import Client
from pal.sizes import DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB, DEFAULT_VCPUS

from .exec_process import exec_process
from .help import examples
from .output import (
    Table,
    api_errors,
    call,
    fail,
    note,
    parse_pairs,
    print_json,
    print_rows,
    print_table,
    read_local,
)
from .stdin import pending_input

FILE_LIMIT = f"{MAX_FILE_BYTES >> 20} MiB"  # the files API limit, in words

vm_app = typer.Typer(
    help="Schedule, inspect, pause, resume, fork, exec in VMs.",
    no_args_is_help=True,
    epilog=examples(
        "VM=$(pal vm schedule --memory-mib 512 -q)",
        "pal vm exec $VM -- /bin/sh -c 'echo hi; uname -r'",
        "pal vm exec $VM --stream -- python3 train.py",
        "pal vm pause $VM; pal vm resume $VM",
        "pal vm fork $VM -n 3",
        "pal vm snapshot $VM --name golden; pal vm start-snapshot golden -n 2",
        "pal vm ls --table --meta run=42",
        "pal vm extend $VM 3600",
        "pal vm rm $VM",
    ),
)
files_app = typer.Typer(
    help=f"Files under a VM's /workspace (any bytes, at most {FILE_LIMIT} each).", no_args_is_help=True
)

VM_COLUMNS = ["vmId", "state", "image", "createdAt", "snapshotId", "parentVmId", "reason"]
TIMEOUT_EXIT_CODE = 124  # what the server answers for a command killed at its timeout
ENDED = ("terminated", "failed")  # states `pal vm ls` shows only with --all: they hold nothing


def client() -> Client:
    return Client()


VmId = Annotated[str, typer.Argument(metavar="VM", help="VM id (vm-...)")]
Allow = Annotated[list[str] | None, typer.Option(help="only this destination (repeatable)")]
Deny = Annotated[list[str] | None, typer.Option(help="everything but this destination (repeatable)")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="print only the VM id")]
Meta = Annotated[list[str] | None, typer.Option("--meta", help="K=V metadata tag (repeatable)")]
Secret = Annotated[list[str] | None, typer.Option("--secret", help="K=V env var for every exec (repeatable)")]
Volumes = Annotated[
    list[str] | None, typer.Option("--volume", help="NAME:/path[:ro]: mount the volume there (repeatable)")
]


def parse_volume(raw: str) -> dict[str, object]:
    """``NAME:/path[:ro]`` -> ``{name, path, readOnly}``."""
    name, _, rest = raw.partition(":")
    path, ro = (rest[:-3], True) if rest.endswith(":ro") else (rest, False)
    if not name or not path.startswith("/"):
        raise typer.BadParameter(f"--volume {raw!r}: NAME:/path or NAME:/path:ro")
    return {"name": name, "path": path, "readOnly": ro}


@vm_app.command(
    "schedule",
    epilog=examples(
        "VM=$(pal vm schedule -q)",
        "pal vm schedule --memory-mib 1024 --vcpus 2 --idle-timeout 300",
        "pal vm schedule --allow pypi.org --allow files.pythonhosted.org",
    ),
)
def schedule(
    image: Annotated[str, typer.Option(help="guest image name")] = "default",
    vcpus: Annotated[int | None, typer.Option(help=f"virtual CPUs (default {DEFAULT_VCPUS})")] = None,
    memory_mib: Annotated[
        int | None, typer.Option(help=f"guest RAM in MiB (default {DEFAULT_MEMORY_MIB})")
    ] = None,
    disk_mib: Annotated[
        int | None, typer.Option(help=f"root disk in MiB (default {DEFAULT_DISK_MIB})")
    ] = None,
    idle_timeout: Annotated[int, typer.Option(help="suspend after N idle seconds (0 = never)")] = 0,
    idle_live_pause: Annotated[
        int, typer.Option(help="first idle tier: live-pause and offload after N idle seconds (0 = off)")
    ] = 0,
    wait_pause: Annotated[
        bool | None,
        typer.Option(help="pause while the guest idles waiting on the network (default: the server's)"),
    ] = None,
    secret: Secret = None,
    cold: Annotated[bool, typer.Option("--cold", help="cold boot instead of a warm template")] = False,
    egress: Annotated[str | None, typer.Option(help="none | open (default: the server's)")] = None,
    allow: Allow = None,
    deny: Deny = None,
    egress_mbps: Annotated[int | None, typer.Option(help="network cap per direction, Mbit/s")] = None,
    max_connections: Annotated[int | None, typer.Option(help="concurrent outbound connections")] = None,
    disk_read_mibps: Annotated[
        int | None, typer.Option(help="disk read cap, MiB/s (default: the server's)")
    ] = None,
    disk_write_mibps: Annotated[
        int | None, typer.Option(help="disk write cap, MiB/s (default: the server's)")
    ] = None,
    disk_iops: Annotated[int | None, typer.Option(help="disk IOPS cap (default: the server's)")] = None,
    meta: Meta = None,
    volume: Volumes = None,
    lifetime: Annotated[
        int, typer.Option(help="end the VM N seconds after its schedule, busy or not (0 = never)")
    ] = 0,
    on_lifetime_end: Annotated[
        str, typer.Option(help="what the lifetime's end does: delete | pause")
    ] = "delete",
    quiet: Quiet = False,
) -> None:
    """Start a sandbox microVM; prints its JSON (with vmId), or only the id with -q.

    Destinations for --allow/--deny: pypi.org, *.example.com, host:port, 1.2.3.4, 10.0.0.0/8[:port].
    """
    given = {
        "vcpus": vcpus,
        "memoryMib": memory_mib,
        "diskMib": disk_mib,
        "egressMbps": egress_mbps,
        "maxConnections": max_connections,
        "diskReadMibps": disk_read_mibps,
        "diskWriteMibps": disk_write_mibps,
        "diskIops": disk_iops,
    }
    limits = {k: v for k, v in given.items() if v is not None}
    spec: dict[str, object] = {"image": image, "idleTimeoutSecs": idle_timeout}
    if idle_live_pause:
        spec["idleLivePauseSecs"] = idle_live_pause
    if wait_pause is not None:
        spec["waitPause"] = {} if wait_pause else False
    if limits:
        spec["limits"] = limits
    if secret:
        spec["secrets"] = parse_pairs(secret, "--secret")
    if cold:
        spec["boot"] = "cold"
    if meta:
        spec["metadata"] = parse_pairs(meta, "--meta")
    if lifetime:
        spec["lifetimeSecs"], spec["onLifetimeEnd"] = lifetime, on_lifetime_end
    spec |= {"volumes": [parse_volume(v) for v in volume]} if volume else {}
    policy = egress_option(egress, allow, deny)
    if policy is not None:
        spec["egress"] = policy
    vm = call(lambda: client().runtime.schedule(**spec))
    if quiet:
        typer.echo(vm["vmId"])
    else:
        print_json(vm)


def egress_option(
    mode: str | None, allow: list[str] | None, deny: list[str] | None
) -> str | dict[str, list[str]] | None:
    """--egress / --allow / --deny as one egress value (None: not given)."""
    given = [x for x in (mode, allow, deny) if x]
    if len(given) > 1:
        raise typer.BadParameter("use one of --egress, --allow or --deny")
    if mode is not None and mode not in ("none", "open"):
        raise typer.BadParameter("--egress must be none or open")
    if allow:
        return {"allow": list(allow)}
    if deny:
        return {"deny": list(deny)}
    return mode


@vm_app.command("egress")
def egress_cmd(
    vm_id: VmId,
    allow: Allow = None,
    deny: Deny = None,
    open_: Annotated[
        bool, typer.Option("--open", help="any destination (internal ones stay closed)")
    ] = False,
    none: Annotated[bool, typer.Option("--none", help="no network at all")] = False,
) -> None:
    """Change a VM's egress policy; a running VM applies it to its next connection."""
    mode = "open" if open_ else ("none" if none else None)
    if open_ and none:
        raise typer.BadParameter("use one of --allow, --deny, --open or --none")
    policy = egress_option(mode, allow, deny)
    if policy is None:
        raise typer.BadParameter("give --allow, --deny, --open or --none")
    print_json(call(lambda: client().runtime.set_egress(vm_id, policy)))


@vm_app.command("ls")
def ls(
    table: Table = False,
    all_: Annotated[bool, typer.Option("--all", "-a", help="include terminated and failed VMs")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the VM ids")] = False,
    meta: Meta = None,
) -> None:
    """List your VMs, every page (terminated and failed ones, which hold nothing, only with --all).

    --meta K=V keeps those tagged so (repeat it: all must match)."""
    wanted = parse_pairs(meta, "--meta") if meta else None
    vms = [v for v in call(lambda: client().runtime.list(wanted)) if all_ or v["state"] not in ENDED]
    if quiet:
        for v in vms:
            typer.echo(v["vmId"])
    else:
        print_rows(vms, VM_COLUMNS, table)


@vm_app.command("extend")
def extend(
    vm_id: VmId,
    secs: Annotated[int, typer.Argument(metavar="SECS", help="seconds added to its lifetime")],
) -> None:
    """Extend a VM's lifetime by SECS (a VM without one gets one ending SECS from now)."""
    print_json(call(lambda: client().runtime.extend_lifetime(vm_id, secs)))


@vm_app.command("get")
def get(vm_id: VmId) -> None:
    """Show one VM: state, limits (and limitsApplied: which held on its host), snapshot, reason."""
    print_json(call(lambda: client().runtime.get(vm_id)))


@vm_app.command("rm")
def rm(vm_id: VmId) -> None:
    """Stop a VM for good (-> terminated); its snapshots are released."""
    print_json(call(lambda: client().runtime.delete(vm_id)))


@vm_app.command("pause")
def pause(
    vm_id: VmId,
    live: Annotated[
        bool, typer.Option("--live", help="stop the vCPUs in place (keeps QEMU and slot)")
    ] = False,
    offload: Annotated[bool, typer.Option("--offload", help="with --live: hand the guest RAM back")] = False,
) -> None:
    """Snapshot and stop a running VM (frees its quota slot), or live-pause it (--live)."""
    if offload and not live:
        raise typer.BadParameter("--offload needs --live")
    mode = "live" if live else "snapshot"
    print_json(call(lambda: client().runtime.pause(vm_id, mode, offload=offload)))


@vm_app.command("resume")
def resume(vm_id: VmId) -> None:
    """Restore a paused VM from its snapshot, under the same id."""
    print_json(call(lambda: client().runtime.resume(vm_id)))


@vm_app.command("fork", epilog=examples("pal vm fork $VM -n 3 --meta run=42 --secret SEED=7"))
def fork(
    vm_id: VmId,
    n: Annotated[int, typer.Option("-n", "--count", help="number of forks")] = 1,
    meta: Meta = None,
    secret: Secret = None,
) -> None:
    """N copy-on-write copies of a running or paused VM.

    --meta K=V tags them instead of the source's tags (repeat it; without it: the
    source's); --secret K=V sets an env var over the source's in each."""
    tags = parse_pairs(meta, "--meta") if meta else None
    secrets = parse_pairs(secret, "--secret") if secret else None
    print_json(call(lambda: client().runtime.fork(vm_id, count=n, metadata=tags, secrets=secrets)))


@vm_app.command("events")
def events(vm_id: VmId) -> None:
    """Status and audit events (transitions, auto_resume)."""
    print_json(call(lambda: client().runtime.events(vm_id)))


@vm_app.command(
    "exec",
    epilog=examples(
        "pal vm exec $VM -- ls -la /workspace",
        "pal vm exec $VM --timeout 30 --env DEBUG=1 -- python3 job.py",
        "pal vm exec $VM --stream -- /bin/sh -c 'for i in 1 2 3; do echo $i; sleep 1; done'",
        "pal vm exec $VM --user root -- apt-get install -y curl",
    ),
)
def exec_(
    vm_id: VmId,
    command: Annotated[
        list[str], typer.Argument(metavar="COMMAND", help="executable and its arguments (after --)")
    ],
    stream: Annotated[bool, typer.Option("--stream", help="print output as it comes (SSE)")] = False,
    env: Annotated[
        list[str] | None, typer.Option(metavar="K=V", help="environment variable (repeatable)")
    ] = None,
    cwd: Annotated[
        str | None, typer.Option(metavar="DIR", help="working directory (default /workspace)")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECS",
            help="kill the command after SECS (buffered default: the server's PAL_EXEC_DEFAULT_TIMEOUT)",
        ),
    ] = None,
    user: Annotated[
        str | None,
        typer.Option(help="`root`, or the workload user (`pal`, or the image's USER; the default)"),
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="start it in the background; print its process id")
    ] = False,
) -> None:
    """Run a command execve-style; exits with the command's exit status (124 on timeout).

    Input piped or redirected into `pal vm exec` is the command's stdin (then it runs as a
    process, docs/processes.md). --detach prints the process id at once: follow it with
    `pal vm attach VM PID`, stop it with `pal vm kill VM PID`."""
    given = pending_input()
    exe, args = command[0], command[1:]
    envs = parse_pairs(env, "--env")
    if detach or given is not None:
        opts = {"env": envs, "cwd": cwd, "timeout_secs": timeout, "user": user}
        exec_process(vm_id, exe, args, opts, detach=detach, stdin=given[1] if given else None)
        return
    rt = client().runtime
    kw = {"env": envs, "cwd": cwd, "timeout_secs": timeout, "user": user}
    with api_errors():
        if not stream:
            res = rt.exec(vm_id, exe, args, **kw)  # type: ignore[arg-type]
            sys.stdout.write(res.stdout)
            sys.stderr.write(res.stderr)
            _exit(res.exit_code, res.timed_out, timeout)
        for ev in rt.exec_stream(vm_id, exe, args, **kw):  # type: ignore[arg-type]
            if ev.type == "process":
                continue  # its process id (docs/processes.md)
            elif ev.type == "stdout":
                sys.stdout.write(ev.data or "")
                sys.stdout.flush()
            elif ev.type == "stderr":
                sys.stderr.write(ev.data or "")
                sys.stderr.flush()
            elif ev.type == "exit":
                _exit(ev.exit_code if ev.exit_code is not None else 1, ev.timed_out, timeout)
            else:
                fail(ev.message or "the command failed", ev.code or "GUEST_ERROR")
        fail("the exec stream ended without an exit status", "GUEST_ERROR")


def _exit(code: int, timed_out: bool, timeout: float | None) -> None:
    if timed_out:
        after = f" after {timeout:g} s" if timeout else ""
        note(f"the command timed out{after} and was killed (exit status {TIMEOUT_EXIT_CODE})")
    raise typer.Exit(code)


@files_app.command("ls")
def files_ls(
    vm_id: VmId,
    path: Annotated[str, typer.Argument(help="directory under /workspace")] = "",
    table: Table = False,
) -> None:
    """List a directory (default /workspace itself)."""
    res = call(lambda: client().runtime.list_files(vm_id, path))
    if table:
        print_table(res["entries"], ["name", "type", "size"])
    else:
        print_json(res)


@files_app.command("cat")
def files_cat(vm_id: VmId, path: Annotated[str, typer.Argument(help="file under /workspace")]) -> None:
    """Write a file's bytes to stdout, exactly (cut at 1 MiB; a note on stderr says so)."""
    data = call(lambda: client().runtime.read_file_bytes(vm_id, path))
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
    if data.truncated:
        note(f"truncated at {FILE_LIMIT} (the files API limit)")


@files_app.command("get")
def files_get(
    vm_id: VmId,
    path: Annotated[str, typer.Argument(help="file under /workspace")],
    local: Annotated[
        Path | None, typer.Argument(help="local file to write; stdout when omitted or -")
    ] = None,
) -> None:
    """Copy a file out of the VM, byte for byte. A file cut at 1 MiB exits with status 1."""
    data = call(lambda: client().runtime.read_file_bytes(vm_id, path))
    if local is None or str(local) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        local.write_bytes(data)
    if data.truncated:
        fail(
            f"{path} is larger than {FILE_LIMIT} (the files API limit): only its first {FILE_LIMIT} "
            "was copied",
            "TRUNCATED",
        )


@files_app.command("put")
def files_put(
    vm_id: VmId,
    path: Annotated[str, typer.Argument(help="file under /workspace (parents are created)")],
    local: Annotated[Path | None, typer.Argument(help="local file; stdin when omitted or -")] = None,
) -> None:
    """Write a file from a local file or stdin, byte for byte (at most 1 MiB)."""
    data = read_local(local)
    print_json(call(lambda: client().runtime.write_file(vm_id, path, data)))


@vm_app.command("port-url")
def port_url(
    vm_id: VmId,
    port: Annotated[int, typer.Argument(help="port of a server inside the VM")],
    expires_in: Annotated[int, typer.Option(help="seconds the link works")] = 3600,
) -> None:
    """Print a signed link that opens PORT of the VM on its own origin, without the API key.

    Prints {url, expiresAt, linkId}; `pal vm port-url-revoke VM LINK_ID` ends it sooner."""
    print_json(call(lambda: client().runtime.port_url(vm_id, port, expires_in)))


@vm_app.command(
    "port-wait",
    epilog=examples(
        "pal vm exec $VM -- sh -c 'setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null &'",
        "pal vm port-wait $VM 8000 --timeout 60 && curl ...",
    ),
)
def port_wait(
    vm_id: VmId,
    port: Annotated[int, typer.Argument(help="port of a server inside the VM")],
    timeout: Annotated[float, typer.Option(metavar="SECS", help="give up after SECS")] = 60,
) -> None:
    """Wait until a server in the VM listens on PORT (for scripts that just started one).

    Exits 0 once a connection to the port opens (it is closed at once), 1 with
    PORT_NOT_LISTENING after the timeout."""
    import asyncio

    from pal.sdk.portforward import wait_listening

    took = call(lambda: asyncio.run(wait_listening(None, None, vm_id, port, timeout)))
    print_json({"vmId": vm_id, "port": port, "listening": True, "waitedSecs": round(took, 1)})


@vm_app.command("port-url-revoke")
def port_url_revoke(
    vm_id: VmId,
    link_id: Annotated[str, typer.Argument(help="the link's linkId (from pal vm port-url)")],
) -> None:
    """Revoke a port link: it opens nothing from now on."""
    print_json(call(lambda: client().runtime.revoke_port_url(vm_id, link_id)))


@vm_app.command("port-forward")
def port_forward(
    vm_id: VmId,
    port: Annotated[int, typer.Argument(help="port of a server inside the VM")],
    local: Annotated[int, typer.Option("--local", help="local port (default: the same as PORT)")] = -1,
    address: Annotated[str, typer.Option(help="local address to listen on")] = "127.0.0.1",
) -> None:
    """Forward a local port to PORT inside the VM through the API (any TCP protocol).

    HTTP, WebSockets...: runs until interrupted; an idle-suspended VM wakes on use."""
    import asyncio

    from pal.sdk.portforward import forward

    def ready(bound: int) -> None:
        print(f"Forwarding {address}:{bound} -> {vm_id} port {port} (Ctrl-C stops)", flush=True)

    def failed(exc: Exception) -> None:
        print(f"connection refused by Pal: {exc}", file=sys.stderr, flush=True)

    local_port = port if local < 0 else local
    with api_errors(), contextlib.suppress(KeyboardInterrupt):
        try:
            run = forward(None, None, vm_id, port, local_port, address, on_ready=ready, on_error=failed)
            asyncio.run(run)
        except OSError as exc:
            fail(f"cannot listen on {address}:{local_port}: {exc.strerror or exc}", "LOCAL_PORT")


@files_app.command("rm")
def files_rm(
    vm_id: VmId, path: Annotated[str, typer.Argument(help="file or symlink under /workspace")]
) -> None:
    """Remove a file or symlink (not a directory)."""
    print_json(call(lambda: client().runtime.delete_file(vm_id, path)))
