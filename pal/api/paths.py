"""Workspace path checks done at the API, so obvious escapes are refused (400) without
waking or touching the VM. The guest harness still enforces symlinks and everything else."""

from __future__ import annotations

from pal.errors import InvalidRequest, PathEscape


def check_workspace_path(path: str, *, required: bool) -> str:
    """Return ``path`` if it is a relative path that stays under /workspace."""
    if "\x00" in path:
        raise PathEscape("path contains a NUL byte")
    if path.startswith("/"):
        raise PathEscape(f"path {path!r} is absolute; paths are relative to /workspace")
    if any(part == ".." for part in path.replace("\\", "/").split("/")):
        raise PathEscape(f"path {path!r} leaves /workspace (.. component)")
    if required and path.strip() in ("", "."):
        raise InvalidRequest("path is required (a file under /workspace)")
    return path
