"""`pal vm shell/ps/attach/kill` and the process side of `pal vm exec` (``--detach``, piped
stdin): processes that outlive their request (docs/processes.md)."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from pal.sdk import Client
from pal.sdk.attach import open_attach

from .help import examples
from .output import Table, api_errors, call, fail, print_json, print_table
from .terminal import attach_terminal, terminal_size
from .vm import VmId, vm_app

PS_COLUMNS = ["processId", "osPid", "running", "exitCode", "tag", "argv"]
SIGNALS = ("INT", "TERM", "KILL", "HUP", "QUIT", "USR1", "USR2", "STOP", "CONT", "WINCH")
SHELLS = (("/bin/bash", ["-l"]), ("/bin/sh", ["-l"]))  # the first the image has
SHELL_TAG = "pal vm shell"
Pid = Annotated[int, typer.Argument(metavar="PID", help="the process's id (processId, from pal vm ps)")]


def _opener(c: Client, vm_id: str, pid: int) -> Any:
    async def open_(offset: int) -> Any:
        return await open_attach(c.base_url, c.api_key, vm_id, pid, offset)

    return open_


def _start_shell(c: Client, vm_id: str, command: list[str] | None, user: str | None) -> dict[str, Any]:
    """A process on a terminal of this window's size: ``command``, else the image's shell."""
    from pal.sdk.errors import BadRequestError

    opts: dict[str, Any] = {"pty": terminal_size(), "tag": SHELL_TAG, "user": user}
    if command:
        return c.runtime.processes.start(vm_id, command[0], command[1:], **opts)
    for i, (exe, args) in enumerate(SHELLS):
        try:
            return c.runtime.processes.start(vm_id, exe, args, **opts)
        except BadRequestError as exc:
            if exc.code != "EXECUTABLE_NOT_FOUND" or i == len(SHELLS) - 1:
                raise
    raise AssertionError("unreachable")


@vm_app.command(
    "shell",
    epilog=examples("pal vm shell $VM", "pal vm shell $VM -- python3", "pal vm shell $VM --user root"),
)
def shell(
    vm_id: VmId,
    command: Annotated[
        list[str] | None, typer.Argument(metavar="[COMMAND]", help="what to run (default: a login shell)")
    ] = None,
    user: Annotated[str | None, typer.Option(help="`root`, or the workload user (the default)")] = None,
) -> None:
    """An interactive terminal in the VM, like `docker exec -it`; exits with its exit status.

    Raw mode, the window size follows this terminal's. Across a pause or a dropped
    connection it reattaches by itself; if this terminal goes away the remote one gets
    SIGHUP. Needs a terminal: with stdin not a TTY use `pal vm exec`."""
    if not (os.isatty(0) and os.isatty(1)):
        fail(
            "pal vm shell needs a terminal (stdin and stdout a TTY); to run a command with "
            "piped input use `pal vm exec VM -- COMMAND`",
            "NOT_A_TERMINAL",
            status=2,
        )
    c = Client()
    with api_errors():
        proc = _start_shell(c, vm_id, command, user)
        pid = int(proc["processId"])
        code = attach_terminal(_opener(c, vm_id, pid), 0, True, f"process {pid}", owned=True)
    raise typer.Exit(code)


@vm_app.command("ps")
def ps(vm_id: VmId, table: Table = False) -> None:
    """The VM's processes, running and recently exited (with their exit codes)."""
    procs = call(lambda: Client().runtime.processes.list(vm_id))
    if table:
        rows = [{**p, "argv": " ".join(p["argv"])} for p in procs]
        print_table(rows, PS_COLUMNS)
    else:
        print_json(procs)


@vm_app.command(
    "attach",
    epilog=examples("pal vm attach $VM 7", "pal vm attach $VM 7 --from 1048576 > rest.log"),
)
def attach(
    vm_id: VmId,
    pid: Pid,
    from_: Annotated[int, typer.Option("--from", metavar="OFFSET", help="output offset to start at")] = 0,
) -> None:
    """Follow a process's output from OFFSET until it exits; exits with its exit status.

    Its bytes exactly. On a terminal process, with this terminal a TTY: interactive, as
    `pal vm shell`. Reattaches by itself across pauses and dropped connections."""
    if from_ < 0:
        raise typer.BadParameter("--from is an output offset (0 or more)")
    c = Client()
    with api_errors():
        proc = c.runtime.processes.get(vm_id, pid)
        interactive = proc.get("pty") is not None and os.isatty(0) and os.isatty(1)
        code = attach_terminal(_opener(c, vm_id, pid), from_, interactive, f"process {pid}")
    raise typer.Exit(code)


@vm_app.command("kill")
def kill(
    vm_id: VmId,
    pid: Pid,
    signal: Annotated[
        str | None,
        typer.Option("--signal", "-s", help=f"send this signal instead ({', '.join(SIGNALS)})"),
    ] = None,
) -> None:
    """Kill a process (its whole group) and forget it; with --signal only send that signal."""
    if signal is None:
        print_json(call(lambda: Client().runtime.processes.kill(vm_id, pid)))
        return
    name = signal.upper().removeprefix("SIG")
    if name not in SIGNALS:
        raise typer.BadParameter(f"--signal must be one of {', '.join(SIGNALS)}")
    print_json(call(lambda: Client().runtime.processes.signal(vm_id, pid, name)))
