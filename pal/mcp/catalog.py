"""The MCP tools' names, descriptions and input schemas, written for a model: what each
tool does, when to use it, what comes back (docs/agents.md). The handlers are in tools.py,
one per name here."""

from __future__ import annotations

from typing import Any

import mcp_types as types

from pal import sizes
from pal.ids import ID_PATTERN
from pal.volume_spec import MAX_VOLUME_MOUNTS

from . import code_tool, snapshot_tools, volume_tools
from .shaping import DEFAULT_OUTPUT_BYTES, MAX_OUTPUT_BYTES

DEFAULT_YIELD_MS = 10_000  # how long run_command waits before it hands back a running process
MAX_YIELD_MS = 60_000  # the API's longest wait (exec's yieldAfterMs, a process wait)
DEFAULT_READ_WAIT_MS = 10_000  # read_process_output waits this long for new output by default
MAX_FORK_COUNT = 10  # per call: each child is a whole VM

# Ids have the API's pattern: anything else is refused before a tool runs (an id is never
# pasted into a URL it could change: `vm-1/resume?x=` is no id).
_VM = {"type": "string", "pattern": ID_PATTERN, "description": "the sandbox's id (vmId), e.g. vm-3f2a…"}
_PID = {"type": "integer", "minimum": 1, "description": "the process id that run_command returned"}
_MAX_BYTES = {
    "type": "integer",
    "minimum": 1,
    "maximum": MAX_OUTPUT_BYTES,
    "description": f"the most bytes of content to return (default {DEFAULT_OUTPUT_BYTES})",
}
_PATH = {
    "type": "string",
    "description": "a path under /workspace (absolute, or relative to /workspace)",
}


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


_EGRESS = {
    "description": 'outbound network: "open" (default), "none", {"allow": [...]} or {"deny": [...]} '
    "with domains (*.example.com), host:port, IPs or CIDRs",
    "oneOf": [
        {"type": "string", "enum": ["open", "none"]},
        _obj({"allow": {"type": "array", "items": {"type": "string"}, "maxItems": 256}}, ["allow"]),
        _obj({"deny": {"type": "array", "items": {"type": "string"}, "maxItems": 256}}, ["deny"]),
    ],
}

_VOLUME_MOUNTS = {
    "type": "array",
    "maxItems": MAX_VOLUME_MOUNTS,
    "description": "your volumes to mount (docs/volumes.md), each at most once, at a path of its own",
    "items": _obj(
        {
            "name": {
                "type": "string",
                "minLength": 1,
                "maxLength": 80,
                "description": "the volume's name or id",
            },
            "path": {
                "type": "string",
                "minLength": 2,
                "maxLength": 256,
                "description": "where in the sandbox, an absolute path (e.g. /mnt/data; not /etc, /usr...)",
            },
            "readOnly": {"type": "boolean", "description": "mount it read-only (default false)"},
        },
        ["name", "path"],
    ),
}

_TOOLS: list[tuple[str, str, dict[str, Any], types.ToolAnnotations]] = [
    (
        "create_sandbox",
        "Create a sandbox: a Linux microVM (Debian, Python 3) with a /workspace directory, ready in a "
        "second or so. Returns its vmId, which every other tool takes. It keeps running (and counts "
        "against the quota) until delete_sandbox; with idleTimeoutSecs it suspends itself when idle "
        "and wakes on the next call. With volumes, your volumes (create_volume) are mounted in it: "
        "what it writes there outlives it, and the volume tools read it.",
        _obj(
            {
                "image": {"type": "string", "description": 'guest image name (default "default")'},
                "memoryMib": {
                    "type": "integer",
                    "minimum": sizes.MEMORY_MIB_RANGE[0],
                    "maximum": sizes.MEMORY_MIB_RANGE[1],
                    "description": f"RAM in MiB (default {sizes.DEFAULT_MEMORY_MIB})",
                },
                "vcpus": {
                    "type": "integer",
                    "minimum": sizes.VCPUS_RANGE[0],
                    "maximum": sizes.VCPUS_RANGE[1],
                    "description": f"virtual CPUs (default {sizes.DEFAULT_VCPUS})",
                },
                "diskMib": {
                    "type": "integer",
                    "minimum": sizes.DISK_MIB_RANGE[0],
                    "maximum": sizes.DISK_MIB_RANGE[1],
                    "description": f"root disk in MiB (default {sizes.DEFAULT_DISK_MIB})",
                },
                "egress": _EGRESS,
                "idleTimeoutSecs": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": 7 * 24 * 3600,
                    "description": "suspend after this many idle seconds (0: never); "
                    "it wakes on its next call",
                },
                "metadata": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "labels to find it by later (string values)",
                },
                "volumes": _VOLUME_MOUNTS,
            },
            [],
        ),
        types.ToolAnnotations(title="Create a sandbox", read_only_hint=False, destructive_hint=False),
    ),
    (
        "list_sandboxes",
        "List your sandboxes with their state (running, paused, suspended, terminated...).",
        _obj({}, []),
        types.ToolAnnotations(title="List sandboxes", read_only_hint=True),
    ),
    (
        "get_sandbox",
        "Show one sandbox: its state, image, size, egress policy and when it was created.",
        _obj({"vmId": _VM}, ["vmId"]),
        types.ToolAnnotations(title="Get a sandbox", read_only_hint=True),
    ),
    (
        "delete_sandbox",
        "Delete a sandbox for good: its processes, files and memory are gone. Use it when done.",
        _obj({"vmId": _VM}, ["vmId"]),
        types.ToolAnnotations(title="Delete a sandbox", destructive_hint=True, idempotent_hint=True),
    ),
    (
        "run_command",
        "Run a shell command (/bin/sh -c) in the sandbox, in /workspace by default. If it ends within "
        f"yieldAfterMs (default {DEFAULT_YIELD_MS} ms) you get its exit code and output. Otherwise it "
        "keeps running in the background and you get its processId and the output so far: call "
        "read_process_output with that processId and the offset given to follow it, "
        "write_process_stdin to answer it (start it with stdin: true), kill_process to stop it. "
        "Long output is cut; the result says the offset to read on from.",
        _obj(
            {
                "vmId": _VM,
                "command": {"type": "string", "minLength": 1, "description": "the shell command line"},
                "cwd": {"type": "string", "description": "working directory (default /workspace)"},
                "env": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "extra environment variables",
                },
                "yieldAfterMs": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_YIELD_MS,
                    "description": "how long to wait for it to finish before returning its processId",
                },
                "timeoutSecs": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "description": "kill it after this many seconds (default: no limit)",
                },
                "stdin": {
                    "type": "boolean",
                    "description": "keep its stdin open for write_process_stdin (default false: no input)",
                },
                "maxBytes": _MAX_BYTES,
            },
            ["vmId", "command"],
        ),
        types.ToolAnnotations(title="Run a command", destructive_hint=True, open_world_hint=True),
    ),
    (
        "read_process_output",
        "Read a process's output (stdout and stderr, in order) from a byte offset, waiting up to "
        f"waitMs (default {DEFAULT_READ_WAIT_MS}) for new output. Returns the output, the offset to "
        "read on from next, and whether it still runs or its exit code. Read again from that offset "
        "until it says the process exited and no output is left.",
        _obj(
            {
                "vmId": _VM,
                "processId": _PID,
                "offset": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "where to start (0: the beginning; else the `next` offset of the "
                    "previous result)",
                },
                "waitMs": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_YIELD_MS,
                    "description": "wait this long for output past offset while the process runs",
                },
                "maxBytes": _MAX_BYTES,
            },
            ["vmId", "processId"],
        ),
        types.ToolAnnotations(title="Read a process's output", read_only_hint=True),
    ),
    (
        "write_process_stdin",
        "Write text to the stdin of a process started with run_command(stdin: true). Set eof: true "
        "to close its stdin after the text (many programs wait for that before they finish).",
        _obj(
            {
                "vmId": _VM,
                "processId": _PID,
                "data": {"type": "string", "description": "the text to write (add \\n for a line)"},
                "eof": {"type": "boolean", "description": "close stdin after writing (default false)"},
            },
            ["vmId", "processId", "data"],
        ),
        types.ToolAnnotations(title="Write to a process's stdin", destructive_hint=False),
    ),
    (
        "kill_process",
        "Stop a running process (and its children) with a signal, KILL by default; its output stays "
        "readable with read_process_output.",
        _obj(
            {
                "vmId": _VM,
                "processId": _PID,
                "signal": {
                    "type": "string",
                    "enum": ["KILL", "TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "STOP", "CONT"],
                    "description": "the signal (default KILL)",
                },
            },
            ["vmId", "processId"],
        ),
        types.ToolAnnotations(title="Kill a process", destructive_hint=True, idempotent_hint=True),
    ),
    (
        "read_file",
        "Read a file under /workspace. Text comes back as text, other files as base64. Files are "
        "read up to 1 MiB; a result cut at maxBytes says the offset to read on from.",
        _obj(
            {
                "vmId": _VM,
                "path": _PATH,
                "offset": {"type": "integer", "minimum": 0, "description": "byte offset to start at"},
                "maxBytes": _MAX_BYTES,
            },
            ["vmId", "path"],
        ),
        types.ToolAnnotations(title="Read a file", read_only_hint=True),
    ),
    (
        "write_file",
        "Create or replace a file under /workspace (parent directories are made). At most 1 MiB.",
        _obj(
            {
                "vmId": _VM,
                "path": _PATH,
                "content": {"type": "string", "description": "the file's content"},
                "encoding": {
                    "type": "string",
                    "enum": ["utf-8", "base64"],
                    "description": "how content is given: utf-8 text (default) or base64 bytes",
                },
            },
            ["vmId", "path", "content"],
        ),
        types.ToolAnnotations(title="Write a file", destructive_hint=True, idempotent_hint=True),
    ),
    (
        "list_files",
        "List a directory under /workspace: names, types and sizes.",
        _obj({"vmId": _VM, "path": {**_PATH, "description": "a directory (default /workspace)"}}, ["vmId"]),
        types.ToolAnnotations(title="List files", read_only_hint=True),
    ),
    (
        "pause_sandbox",
        "Pause a sandbox: its memory, processes and files are kept in a snapshot and it stops using "
        "CPU and its quota slot (mode snapshot, default), or its CPUs stop in place (mode live). "
        "resume_sandbox continues it exactly where it was; running processes continue too.",
        _obj(
            {
                "vmId": _VM,
                "mode": {
                    "type": "string",
                    "enum": ["snapshot", "live"],
                    "description": "snapshot (default: frees its slot) or live (stops in place, "
                    "connections kept)",
                },
            },
            ["vmId"],
        ),
        types.ToolAnnotations(title="Pause a sandbox", destructive_hint=False, idempotent_hint=True),
    ),
    (
        "resume_sandbox",
        "Resume a paused sandbox: its memory and processes continue where they were.",
        _obj({"vmId": _VM}, ["vmId"]),
        types.ToolAnnotations(title="Resume a sandbox", destructive_hint=False, idempotent_hint=True),
    ),
    (
        "fork_sandbox",
        "Fork a sandbox into count copies (new vmIds), each starting from the parent's current "
        "memory, processes and files, then diverging. Use it to try several approaches from one "
        "prepared state. Each child is a sandbox of its own: delete them when done. They carry "
        "the parent's metadata unless you give metadata.",
        _obj(
            {
                "vmId": _VM,
                "count": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_FORK_COUNT,
                    "description": "how many children (default 1)",
                },
                "metadata": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "labels for the children instead of the parent's (string values)",
                },
            },
            ["vmId"],
        ),
        types.ToolAnnotations(title="Fork a sandbox", destructive_hint=False),
    ),
    (
        "get_port_url",
        "Get a signed URL that reaches a TCP port served inside the sandbox (a web app, a notebook) "
        "from a browser, without an API key, until it expires.",
        _obj(
            {
                "vmId": _VM,
                "port": {"type": "integer", "minimum": 1, "maximum": 65535, "description": "the guest port"},
                "expiresInSecs": {
                    "type": "integer",
                    "minimum": 60,
                    "maximum": 7 * 24 * 3600,
                    "description": "how long the URL works (default 3600)",
                },
            },
            ["vmId", "port"],
        ),
        types.ToolAnnotations(title="Get a port's URL", read_only_hint=False, destructive_hint=False),
    ),
    (
        "run_code",
        code_tool.DESCRIPTION,
        _obj({"vmId": _VM, **code_tool.SCHEMA_PROPS}, ["vmId", "code"]),
        types.ToolAnnotations(title="Run a code cell", read_only_hint=False, destructive_hint=False),
    ),
]

TOOLS: list[types.Tool] = [
    types.Tool(name=name, description=desc, input_schema=schema, annotations=notes)
    for name, desc, schema, notes in [*_TOOLS, *snapshot_tools.TOOLS, *volume_tools.TOOLS]
]
SCHEMAS: dict[str, dict[str, Any]] = {t.name: t.input_schema for t in TOOLS}
