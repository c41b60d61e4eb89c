"""The MCP tools: each one a few calls of the Python SDK (``AsyncClient``), whichever
transport brought the call (stdio: PAL_URL and PAL_API_KEY; HTTP: the caller's key, in
process). Their schemas and descriptions are in catalog.py; results are shaped by
shaping.py; dispatch.py validates the arguments, turns API errors into tool errors and
audits the call."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from pal.sdk import AsyncClient

from . import code_tool, snapshot_tools, volume_tools
from .catalog import DEFAULT_READ_WAIT_MS, DEFAULT_YIELD_MS
from .shaping import (
    DEFAULT_OUTPUT_BYTES,
    cut_items,
    error_result,
    file_slice,
    json_result,
    render_output,
    text_result,
)

SHELL = "/bin/sh"
# A VM's fields a model needs (the rest is in get_sandbox's full answer).
_VM_SUMMARY = ("vmId", "state", "image", "createdAt", "parentVmId", "idleTimeoutSecs", "metadata")


@dataclass(frozen=True)
class Outcome:
    """A tool's result and the VMs its call is audited on (none: the call touched none)."""

    result: types.CallToolResult
    vms: tuple[str, ...] = ()


Handler = Callable[[AsyncClient, dict[str, Any]], Awaitable[Outcome]]


def _summary(vm: dict[str, Any]) -> dict[str, Any]:
    return {k: vm[k] for k in _VM_SUMMARY if vm.get(k) is not None}


async def create_sandbox(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    spec: dict[str, Any] = {
        k: a[k] for k in ("image", "egress", "idleTimeoutSecs", "metadata", "volumes") if k in a
    }
    limits = {k: a[k] for k in ("memoryMib", "vcpus", "diskMib") if k in a}
    if limits:
        spec["limits"] = limits
    vm = await c.runtime.schedule(**spec)
    return Outcome(json_result(f"Created sandbox {vm['vmId']} ({vm['state']}).", _summary(vm)), (vm["vmId"],))


async def list_sandboxes(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vms = [_summary(v) for v in await c.runtime.list()]
    return Outcome(json_result(f"{len(vms)} sandbox(es).", {"sandboxes": vms}))


async def get_sandbox(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm = await c.runtime.get(a["vmId"])
    return Outcome(json_result(f"Sandbox {vm['vmId']} is {vm['state']}.", vm), (a["vmId"],))


async def delete_sandbox(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm = await c.runtime.delete(a["vmId"])
    return Outcome(json_result(f"Deleted sandbox {a['vmId']}.", _summary(vm)), (a["vmId"],))


async def _process_result(
    c: AsyncClient, vm_id: str, pid: int, offset: int, wait_ms: int, limit: int
) -> types.CallToolResult:
    """One read of a process's output from ``offset``, cut to ``limit`` bytes, with what the
    model does next: read on from ``next``, or nothing (it exited, all output read)."""
    res = await c.runtime.processes.read(vm_id, pid, offset, wait_ms=wait_ms)
    items, taken = cut_items(res["output"], limit)
    start = int(res["from"]) + int(res["gap"])
    nxt = start + taken
    proc = res["process"]
    journal_end = int(proc["journal"]["end"])
    running = bool(proc["running"])
    text = render_output(items)
    lines = []
    if res["gap"]:
        lines.append(f"[{res['gap']} earlier bytes were dropped by the output journal's bound]")
    lines.append(text if text else "(no new output)")
    more = nxt < journal_end
    if more:
        lines.append(
            f"[output cut at {limit} bytes: {journal_end - nxt} more so far; call read_process_output "
            f"with processId={pid}, offset={nxt}]"
        )
    if running:
        status = (
            f"Process {pid} is still running. "
            f"Read on with read_process_output(processId={pid}, offset={nxt})."
        )
    else:
        code = proc.get("exitCode")
        how = "timed out (killed), " if proc.get("timedOut") else ""
        status = f"Process {pid} exited: {how}exit code {code}." + ("" if more else " All output read.")
    structured = {
        "processId": pid,
        "running": running,
        "exitCode": None if running else proc.get("exitCode"),
        "timedOut": bool(proc.get("timedOut")),
        "offset": start,
        "next": nxt,
        "complete": not running and not more,
        "output": text,
    }
    return text_result(status + "\n" + "\n".join(lines), structured)


async def run_command(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm_id = a["vmId"]
    procs = c.runtime.processes
    opts: dict[str, Any] = {k: a[k] for k in ("env", "cwd") if k in a}
    if "timeoutSecs" in a:
        opts["timeout_secs"] = a["timeoutSecs"]
    proc = await procs.start(vm_id, SHELL, ["-c", a["command"]], stdin=bool(a.get("stdin")), **opts)
    pid = int(proc["processId"])
    # exec's yieldAfterMs, as a process (so stdin can stay open): wait, then read what it wrote.
    await procs.wait(vm_id, pid, timeout_secs=a.get("yieldAfterMs", DEFAULT_YIELD_MS) / 1000)
    limit = a.get("maxBytes", DEFAULT_OUTPUT_BYTES)
    return Outcome(await _process_result(c, vm_id, pid, 0, 0, limit), (vm_id,))


async def read_process_output(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm_id, pid = a["vmId"], int(a["processId"])
    wait_ms = a.get("waitMs", DEFAULT_READ_WAIT_MS)
    limit = a.get("maxBytes", DEFAULT_OUTPUT_BYTES)
    return Outcome(await _process_result(c, vm_id, pid, a.get("offset", 0), wait_ms, limit), (vm_id,))


async def write_process_stdin(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm_id, pid = a["vmId"], int(a["processId"])
    data = a["data"].encode("utf-8")
    eof = bool(a.get("eof"))
    await c.runtime.processes.send_stdin(vm_id, pid, data, eof=eof)
    closed = " and closed its stdin" if eof else ""
    return Outcome(text_result(f"Wrote {len(data)} bytes to process {pid}{closed}."), (vm_id,))


async def kill_process(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm_id, pid = a["vmId"], int(a["processId"])
    sig = a.get("signal", "KILL")
    await c.runtime.processes.signal(vm_id, pid, sig)
    return Outcome(text_result(f"Sent {sig} to process {pid} (and its children)."), (vm_id,))


async def read_file(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm_id, path = a["vmId"], a["path"]
    offset, limit = a.get("offset", 0), a.get("maxBytes", DEFAULT_OUTPUT_BYTES)
    data = await c.runtime.read_file_bytes(vm_id, path)
    if offset > len(data):
        return Outcome(
            error_result(f"offset {offset} is past the end of {path} ({len(data)} bytes)"), (vm_id,)
        )
    content, encoding, given = file_slice(data, offset, limit)
    end = offset + given
    head = f"{path}: bytes {offset}..{end} of {len(data)}" + (
        " (base64: not UTF-8 text)" if encoding != "utf-8" else ""
    )
    tail = []
    if end < len(data):
        tail.append(f"[cut: call read_file with path={path!r}, offset={end} for the rest]")
    elif data.truncated:
        tail.append("[the file is larger than 1 MiB; only its first 1 MiB can be read here: use run_command]")
    structured = {"path": path, "offset": offset, "next": end, "size": len(data), "encoding": encoding}
    return Outcome(
        text_result("\n".join([head, content, *tail]), {**structured, "content": content}), (vm_id,)
    )


async def write_file(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm_id, path = a["vmId"], a["path"]
    if a.get("encoding") == "base64":
        try:
            data = base64.b64decode(a["content"], validate=True)
        except ValueError:
            return Outcome(error_result("content is not valid base64 (or send encoding utf-8)"), (vm_id,))
    else:
        data = a["content"].encode("utf-8")
    res = await c.runtime.write_file(vm_id, path, data)
    return Outcome(text_result(f"Wrote {res['bytesWritten']} bytes to {res['path']}."), (vm_id,))


async def list_files(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm_id = a["vmId"]
    res = await c.runtime.list_files(vm_id, a.get("path", ""))
    n = len(res["entries"])
    more = " (cut: the directory has more entries)" if res.get("truncated") else ""
    return Outcome(json_result(f"{res['path']}: {n} entries{more}.", res), (vm_id,))


async def pause_sandbox(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm = await c.runtime.pause(a["vmId"], a.get("mode", "snapshot"))
    return Outcome(json_result(f"Sandbox {a['vmId']} is {vm['state']}.", vm), (a["vmId"],))


async def resume_sandbox(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    vm = await c.runtime.resume(a["vmId"])
    return Outcome(json_result(f"Sandbox {a['vmId']} is {vm['state']}.", vm), (a["vmId"],))


async def fork_sandbox(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    res = await c.runtime.fork(a["vmId"], a.get("count", 1), metadata=a.get("metadata"))
    kids = [f["vmId"] for f in res["forks"]]
    return Outcome(json_result(f"Forked {a['vmId']} into {', '.join(kids)}.", res), (a["vmId"], *kids))


async def get_port_url(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    res = await c.runtime.port_url(a["vmId"], a["port"], a.get("expiresInSecs", 3600))
    return Outcome(json_result(f"Port {a['port']} of {a['vmId']}: {res['url']}", res), (a["vmId"],))


async def run_code(c: AsyncClient, a: dict[str, Any]) -> Outcome:
    return Outcome(await code_tool.run_code(c, a), (a["vmId"],))


HANDLERS: dict[str, Handler] = {
    "create_sandbox": create_sandbox,
    "list_sandboxes": list_sandboxes,
    "get_sandbox": get_sandbox,
    "delete_sandbox": delete_sandbox,
    "run_command": run_command,
    "read_process_output": read_process_output,
    "write_process_stdin": write_process_stdin,
    "kill_process": kill_process,
    "read_file": read_file,
    "write_file": write_file,
    "list_files": list_files,
    "pause_sandbox": pause_sandbox,
    "resume_sandbox": resume_sandbox,
    "fork_sandbox": fork_sandbox,
    "get_port_url": get_port_url,
    "run_code": run_code,
}


def _on_no_vm(fn: Callable[[AsyncClient, dict[str, Any]], Awaitable[types.CallToolResult]]) -> Handler:
    async def call(c: AsyncClient, a: dict[str, Any]) -> Outcome:
        return Outcome(await fn(c, a))

    return call


HANDLERS.update({name: _on_no_vm(fn) for name, fn in volume_tools.HANDLERS.items()})


def _audited(fn: Callable[[AsyncClient, dict[str, Any]], Awaitable[snapshot_tools.Result]]) -> Handler:
    async def call(c: AsyncClient, a: dict[str, Any]) -> Outcome:
        result, vms = await fn(c, a)
        return Outcome(result, vms)

    return call


HANDLERS.update({name: _audited(fn) for name, fn in snapshot_tools.HANDLERS.items()})
