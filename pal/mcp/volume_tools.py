"""The MCP tools of volumes (docs/volumes.md): list and create a tenant's volumes, list,
read and write their files, without a sandbox. Mounting a volume into a sandbox is
create_sandbox's (its ``volumes``). A volume call touches no VM, so it is audited on none."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types

from pal.sdk import AsyncClient

from .shaping import (
    DEFAULT_OUTPUT_BYTES,
    MAX_OUTPUT_BYTES,
    error_result,
    file_slice,
    json_result,
    text_result,
)

_VOLUME = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "description": "the volume's name or id (vol-…)",
}
_VPATH = {
    "type": "string",
    "description": "a path in the volume, relative to its root (symlinks are not followed)",
}


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


TOOLS: list[tuple[str, str, dict[str, Any], types.ToolAnnotations]] = [
    (
        "list_volumes",
        "List your volumes: persistent storage that outlives any sandbox (a repository, a cache, "
        "a dataset, results), each with its name, id, size limit and state.",
        _obj({}, []),
        types.ToolAnnotations(title="List volumes", read_only_hint=True),
    ),
    (
        "create_volume",
        "Create a volume: persistent storage, by name, that outlives any sandbox. Fill it and read "
        "it with write_volume_file / read_volume_file, or mount it in a sandbox (create_sandbox's "
        "volumes).",
        _obj(
            {
                "name": {
                    "type": "string",
                    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                    "description": "unique among your volumes: 1-63 of A-Z a-z 0-9 . _ -",
                },
                "sizeMib": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "its size limit in MiB (default 1024)",
                },
            },
            ["name"],
        ),
        types.ToolAnnotations(title="Create a volume", destructive_hint=False),
    ),
    (
        "list_volume_files",
        "List a directory of a volume (default its root): names, paths, types and sizes.",
        _obj(
            {
                "volume": _VOLUME,
                "path": {**_VPATH, "description": "a directory of the volume (default its root)"},
                "depth": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 16,
                    "description": "levels down (default 1)",
                },
            },
            ["volume"],
        ),
        types.ToolAnnotations(title="List a volume's files", read_only_hint=True),
    ),
    (
        "read_volume_file",
        "Read a file of a volume. Text comes back as text, other files as base64. Files are read "
        "up to 1 MiB; a result cut at maxBytes says the offset to read on from.",
        _obj(
            {
                "volume": _VOLUME,
                "path": _VPATH,
                "offset": {"type": "integer", "minimum": 0, "description": "byte offset to start at"},
                "maxBytes": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_OUTPUT_BYTES,
                    "description": f"the most bytes of content to return (default {DEFAULT_OUTPUT_BYTES})",
                },
            },
            ["volume", "path"],
        ),
        types.ToolAnnotations(title="Read a volume's file", read_only_hint=True),
    ),
    (
        "write_volume_file",
        "Create or replace a file of a volume (parent directories are made). At most 1 MiB.",
        _obj(
            {
                "volume": _VOLUME,
                "path": _VPATH,
                "content": {"type": "string", "description": "the file's content"},
                "encoding": {
                    "type": "string",
                    "enum": ["utf-8", "base64"],
                    "description": "how content is given: utf-8 text (default) or base64 bytes",
                },
            },
            ["volume", "path", "content"],
        ),
        types.ToolAnnotations(title="Write a volume's file", destructive_hint=True, idempotent_hint=True),
    ),
]

_VOLUME_FIELDS = ("volumeId", "name", "sizeMib", "state", "metadata", "createdAt")


async def list_volumes(c: AsyncClient, a: dict[str, Any]) -> types.CallToolResult:
    vols = [{k: v[k] for k in _VOLUME_FIELDS if k in v} for v in await c.volumes.list()]
    return json_result(f"{len(vols)} volume(s).", {"volumes": vols})


async def create_volume(c: AsyncClient, a: dict[str, Any]) -> types.CallToolResult:
    vol = await c.volumes.create(a["name"], a.get("sizeMib"))
    return json_result(f"Volume {vol['name']} ({vol['volumeId']}) is {vol['state']}.", vol)


async def list_volume_files(c: AsyncClient, a: dict[str, Any]) -> types.CallToolResult:
    res = await c.volumes.list_files(a["volume"], a.get("path", ""), depth=a.get("depth"))
    more = " (cut: the directory has more entries)" if res.get("truncated") else ""
    return json_result(f"{res['path'] or '/'}: {len(res['entries'])} entries{more}.", res)


async def read_volume_file(c: AsyncClient, a: dict[str, Any]) -> types.CallToolResult:
    volume, path = a["volume"], a["path"]
    offset, limit = a.get("offset", 0), a.get("maxBytes", DEFAULT_OUTPUT_BYTES)
    data = await c.volumes.read_file_bytes(volume, path)
    if offset > len(data):
        return error_result(f"offset {offset} is past the end of {path} ({len(data)} bytes)")
    content, encoding, given = file_slice(data, offset, limit)
    end = offset + given
    head = f"{path}: bytes {offset}..{end} of {len(data)}" + (
        " (base64: not UTF-8 text)" if encoding != "utf-8" else ""
    )
    tail = []
    if end < len(data):
        tail.append(f"[cut: call read_volume_file with path={path!r}, offset={end} for the rest]")
    elif data.truncated:
        tail.append("[the file is larger than 1 MiB; only its first 1 MiB can be read here]")
    structured = {"path": path, "offset": offset, "next": end, "size": len(data), "encoding": encoding}
    return text_result("\n".join([head, content, *tail]), {**structured, "content": content})


async def write_volume_file(c: AsyncClient, a: dict[str, Any]) -> types.CallToolResult:
    if a.get("encoding") == "base64":
        try:
            data = base64.b64decode(a["content"], validate=True)
        except ValueError:
            return error_result("content is not valid base64 (or send encoding utf-8)")
    else:
        data = a["content"].encode("utf-8")
    res = await c.volumes.write_file(a["volume"], a["path"], data)
    return text_result(f"Wrote {res['bytesWritten']} bytes to {res['path']} in volume {a['volume']}.")


HANDLERS: dict[str, Callable[[AsyncClient, dict[str, Any]], Awaitable[types.CallToolResult]]] = {
    "list_volumes": list_volumes,
    "create_volume": create_volume,
    "list_volume_files": list_volume_files,
    "read_volume_file": read_volume_file,
    "write_volume_file": write_volume_file,
}
