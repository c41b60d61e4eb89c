"""`pal vm exec` as a process (docs/processes.md): ``--detach`` prints its id; input piped
into `pal vm exec` is passed to its stdin while its output is followed."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import typer

from pal.sdk import Client

from .output import api_errors, fail


def exec_process(
    vm_id: str,
    exe: str,
    args: list[str],
    opts: dict[str, Any],
    *,
    detach: bool,
    stdin: bytes | None,
) -> None:
    """`pal vm exec` as a process: ``detach`` prints its id and returns; else its output is
    followed (stdout and stderr apart) while ``stdin`` (the rest of our stdin after these
    first bytes) is passed to it, and its exit status is ours."""
    c = Client()
    p = c.runtime.processes
    with api_errors():
        proc = p.start(vm_id, exe, args, stdin=stdin is not None, **opts)
        pid = int(proc["processId"])
        feeder = None
        if stdin is not None:
            feeder = _Feeder(p, vm_id, pid, stdin)
            if detach:
                feeder.run()
            else:
                feeder.start()
        if detach:
            typer.echo(pid)
            return
        for ev in p.output(vm_id, pid):
            if ev.type in ("stdout", "stderr"):
                stream = sys.stdout if ev.type == "stdout" else sys.stderr
                stream.buffer.write(ev.data)
                stream.flush()
            elif ev.type == "exit":
                if feeder is not None and feeder.error is not None:
                    fail(f"could not pass stdin on: {feeder.error}", "STDIN_FAILED")
                if ev.timed_out:
                    sys.stderr.write("pal: the command timed out and was killed (exit status 124)\n")
                raise typer.Exit(124 if ev.timed_out else (ev.exit_code if ev.exit_code is not None else 1))
    fail("the output stream ended without an exit status", "GUEST_ERROR")


class _Feeder(threading.Thread):
    """Our stdin to the process's, then its end (closes the process's stdin)."""

    CHUNK = 256 * 1024

    def __init__(self, procs: Any, vm_id: str, pid: int, first: bytes) -> None:
        super().__init__(daemon=True)
        self.procs, self.vm_id, self.pid, self.first = procs, vm_id, pid, first
        self.error: str | None = None

    def run(self) -> None:
        try:
            data = self.first
            while True:
                more = os.read(0, self.CHUNK)
                if not more:
                    self.procs.send_stdin(self.vm_id, self.pid, data, eof=True)
                    return
                if data:
                    self.procs.send_stdin(self.vm_id, self.pid, data)
                data = more
        except Exception as exc:  # the process exited, the server went away...
            self.error = str(exc)
