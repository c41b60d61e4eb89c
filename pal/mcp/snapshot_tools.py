"""The MCP tools of kept snapshots (docs/lifecycle.md, "Kept snapshots"): take one of a
sandbox, list them, start new sandboxes from one, let one go. A take is audited on its
sandbox, a start on each new one; a list or a delete touches no running VM."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types

from pal.ids import ID_PATTERN
from pal.sdk import AsyncClient

from .shaping import json_result

MAX_START_COUNT = 10  # per call, as fork_sandbox's: each is a whole VM
MAX_LISTED = 100  # snapshots in one list answer, the newest (the rest: narrow it by vmId or name)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # pal/scheduler/kept.py's NAME

_VM = {"type": "string", "pattern": ID_PATTERN, "description": "the sandbox's id (vmId), e.g. vm-3f2a…"}
_SNAPSHOT = {
    "type": "string",
    "minLength": 1,
    "maxLength": 200,
    "description": "the snapshot's id (snap-…) or its name",
}
_KEPT_FIELDS = ("snapshotId", "name", "sourceVmId", "createdAt")


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


TOOLS: list[tuple[str, str, dict[str, Any], types.ToolAnnotations]] = [
    (
        "snapshot_sandbox",
        "Keep a snapshot of a sandbox: its memory, running processes and files as they are now, "
        "by a name if you give one. The sandbox runs on (a paused one stays paused). The snapshot "
        "outlives the sandbox; start_from_snapshot starts new sandboxes from it, as many times as "
        "you like. Use it to prepare an environment once (install, load data) and start fresh "
        "copies of it later. It counts against your snapshot storage until delete_snapshot.",
        _obj(
            {
                "vmId": _VM,
                "name": {
                    "type": "string",
                    "pattern": NAME_PATTERN,
                    "description": "1-100 of A-Z a-z 0-9 . _ - (a name another snapshot has moves to this "
                    "one; not an image's name, not snap-…)",
                },
            },
            ["vmId"],
        ),
        types.ToolAnnotations(title="Snapshot a sandbox", read_only_hint=False, destructive_hint=False),
    ),
    (
        "list_snapshots",
        "List your kept snapshots (snapshot_sandbox), oldest first: id, name, the sandbox each was "
        "taken of, when.",
        _obj(
            {
                "vmId": {**_VM, "description": "only the snapshots of this sandbox (it may be deleted)"},
                "name": {**_SNAPSHOT, "description": "only the snapshot of this name (or id)"},
            },
            [],
        ),
        types.ToolAnnotations(title="List snapshots", read_only_hint=True),
    ),
    (
        "start_from_snapshot",
        "Start count new sandboxes from a kept snapshot: each has the snapshot's memory, running "
        "processes and files, its own vmId, and the settings of the sandbox it was taken of. They "
        "carry that sandbox's metadata unless you give metadata. Each is a sandbox of its own: "
        "delete them when done.",
        _obj(
            {
                "snapshot": _SNAPSHOT,
                "count": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_START_COUNT,
                    "description": "how many sandboxes (default 1)",
                },
                "metadata": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "labels for the new sandboxes instead of the source's (string values)",
                },
            },
            ["snapshot"],
        ),
        types.ToolAnnotations(title="Start from a snapshot", read_only_hint=False, destructive_hint=False),
    ),
    (
        "delete_snapshot",
        "Delete a kept snapshot (by id or name): no sandbox can start from it any more, and its "
        "storage is freed. The sandboxes already started from it are not touched.",
        _obj({"snapshot": _SNAPSHOT}, ["snapshot"]),
        types.ToolAnnotations(title="Delete a snapshot", destructive_hint=True, idempotent_hint=True),
    ),
]

Result = tuple[types.CallToolResult, tuple[str, ...]]  # the result and the VMs it is audited on


def _kept(k: dict[str, Any]) -> dict[str, Any]:
    return {f: k[f] for f in _KEPT_FIELDS if k.get(f) is not None}


async def snapshot_sandbox(c: AsyncClient, a: dict[str, Any]) -> Result:
    kept = await c.runtime.keep_snapshot(a["vmId"], a.get("name"))
    named = f" as {kept['name']!r}" if kept.get("name") else ""
    return json_result(f"Kept snapshot {kept['snapshotId']}{named} of {a['vmId']}.", _kept(kept)), (
        a["vmId"],
    )


async def list_snapshots(c: AsyncClient, a: dict[str, Any]) -> Result:
    found = [_kept(k) for k in await c.runtime.kept_snapshots(vm_id=a.get("vmId"), name=a.get("name"))]
    shown = found[-MAX_LISTED:]
    more = f" (the newest {len(shown)} shown: narrow it by vmId or name)" if len(shown) < len(found) else ""
    return json_result(f"{len(found)} snapshot(s){more}.", {"snapshots": shown}), ()


async def start_from_snapshot(c: AsyncClient, a: dict[str, Any]) -> Result:
    res = await c.runtime.start_from_snapshot(a["snapshot"], a.get("count", 1), metadata=a.get("metadata"))
    kids = [f["vmId"] for f in res["forks"]]
    failed = [f"{f['vmId']}: {f['error']}" for f in res["forks"] if f.get("error")]
    why = f" Failed: {'; '.join(failed)}." if failed else ""
    text = f"Started {', '.join(kids)} from snapshot {res['snapshotId']}.{why}"
    return json_result(text, res), tuple(kids)


async def delete_snapshot(c: AsyncClient, a: dict[str, Any]) -> Result:
    gone = await c.runtime.delete_kept_snapshot(a["snapshot"])
    return json_result(f"Deleted snapshot {gone['snapshotId']}.", _kept(gone)), ()


HANDLERS: dict[str, Callable[[AsyncClient, dict[str, Any]], Awaitable[Result]]] = {
    "snapshot_sandbox": snapshot_sandbox,
    "list_snapshots": list_snapshots,
    "start_from_snapshot": start_from_snapshot,
    "delete_snapshot": delete_snapshot,
}
