"""Files' user metadata as extended attributes (E2B's ``X-Metadata-*``, envd.yaml): each key
``k`` is the xattr ``user.e2b.k``. ``xget {paths, root}`` -> ``{metadata: [{k: v} ...]}``
(one map a path, empty for a missing file or one without); ``xset {path, metadata, root}``
-> ``{path, metadata}`` replaces the file's ``user.e2b.*`` with the given map (``{}``
clears it). Paths are absolute (any path of the guest: E2B's calls are not confined to
the workspace), used as the workload user (its fsuid: the kernel checks that user's
permissions) unless ``root``. Symlinks are not followed (a link has no user xattrs).

Stdlib only: the host imports :func:`check_metadata` to refuse what the guest would.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from pal.guest import protocol as P
from pal.guest.errors import ExecError

PREFIX = "user.e2b."
MAX_KEY_BYTES = 246  # the VFS's 255-byte xattr name less the prefix
MAX_TOTAL_BYTES = 4096  # keys (with the prefix each) and values of one file
MAX_PATHS = 1000  # one xget
MAX_PATH_BYTES = 4096
KEY = re.compile(r"\A[!#$%&'*+\-.^_`|~0-9a-z]+\Z")  # an HTTP header name's token, lowercased
VALUE = re.compile(r"\A[\x20-\x7e]*\Z")  # printable US-ASCII


def check_metadata(metadata: Any) -> str | None:
    """Why ``metadata`` cannot be a file's metadata (None: it can): a map of lowercase
    header-token keys of 1..246 bytes to printable US-ASCII values, 4096 bytes in all
    (each key counted with the ``user.e2b.`` prefix), E2B's bounds."""
    if not isinstance(metadata, dict):
        return "metadata must be an object of strings"
    total = 0
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            return "metadata keys and values must be strings"
        if not KEY.match(key) or len(key) > MAX_KEY_BYTES:
            return (
                f"metadata key {key[:64]!r}: 1..{MAX_KEY_BYTES} characters of an HTTP header name, lowercase"
            )
        if not VALUE.match(value):
            return f"metadata value of {key!r}: printable US-ASCII only"
        total += len(PREFIX) + len(key) + len(value)
    if total > MAX_TOTAL_BYTES:
        return (
            f"metadata of {total} bytes (keys, each with {PREFIX!r}, and values): at most {MAX_TOTAL_BYTES}"
        )
    return None


def _nofollow(target: str | int) -> dict[str, bool]:
    return {} if isinstance(target, int) else {"follow_symlinks": False}


def parse_metadata(raw: str) -> dict[str, str]:
    """A JSON object of file metadata, checked by :func:`check_metadata` (ValueError)."""
    try:
        value = json.loads(raw)
    except ValueError:
        raise ValueError("metadata must be a JSON object") from None
    why = check_metadata(value)
    if why is not None:
        raise ValueError(why)
    return dict(value)


def read(target: str | int) -> dict[str, str]:
    """The file's ``user.e2b.*`` metadata ({} for a missing file or a link)."""
    try:
        names = os.listxattr(target, **_nofollow(target))
    except OSError as exc:
        if exc.errno in (
            errno.ENOENT,
            errno.ENOTDIR,
            errno.ENOTSUP,
            errno.EOPNOTSUPP,
            errno.EACCES,
            errno.EPERM,
        ):
            return {}
        raise
    out: dict[str, str] = {}
    for name in names:
        if not name.startswith(PREFIX):
            continue
        with contextlib.suppress(OSError):  # gone since listed
            value = os.getxattr(target, name, **_nofollow(target))
            out[name[len(PREFIX) :]] = value.decode("ascii", "replace")
    return out


def replace(target: str | int, metadata: dict[str, str], what: str) -> dict[str, str]:
    """The file's (a path or an open descriptor) ``user.e2b.*`` made exactly ``metadata``.
    On a failure none is left (a half-replaced map would pass for the caller's)."""
    nofollow = _nofollow(target)
    try:
        for name in os.listxattr(target, **nofollow):
            if name.startswith(PREFIX) and name[len(PREFIX) :] not in metadata:
                os.removexattr(target, name, **nofollow)
        for key, value in metadata.items():
            os.setxattr(target, PREFIX + key, value.encode("ascii"), **nofollow)
    except OSError as exc:
        if metadata:
            with contextlib.suppress(OSError, ExecError):
                replace(target, {}, what)
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise ExecError(
                P.ERR_INVAL, f"the file system of {what} keeps no user metadata (xattrs)"
            ) from None
        if exc.errno in (errno.ENOSPC, errno.E2BIG, errno.ERANGE):
            raise ExecError(P.ERR_INVAL, f"the metadata does not fit the xattr space of {what}") from None
        raise
    return read(target)


def _path(raw: Any) -> str:
    if (
        not isinstance(raw, str)
        or not raw.startswith("/")
        or "\0" in raw
        or len(raw.encode()) > MAX_PATH_BYTES
    ):
        raise ExecError(P.ERR_INVAL, "paths must be absolute")
    return raw


class FileMetadata:
    """The ``xget``/``xset`` requests, as the workload user (``as_user``) or root."""

    def __init__(self, as_user: Callable[[], AbstractContextManager[None]]) -> None:
        self.as_user = as_user

    @contextlib.contextmanager
    def _as(self, msg: dict[str, Any]) -> Iterator[None]:
        if msg.get("root") is True:
            yield
        else:
            with self.as_user():
                yield

    def get(self, msg: dict[str, Any]) -> dict[str, Any]:
        paths = msg.get("paths")
        if not isinstance(paths, list) or len(paths) > MAX_PATHS:
            raise ExecError(P.ERR_INVAL, f"paths must be a list of at most {MAX_PATHS}")
        checked = [_path(p) for p in paths]
        with self._as(msg):
            return {"metadata": [read(p) for p in checked]}

    def set(self, msg: dict[str, Any]) -> dict[str, Any]:
        path, metadata = _path(msg.get("path")), msg.get("metadata")
        why = check_metadata(metadata)
        if why is not None:
            raise ExecError(P.ERR_INVAL, why)
        assert isinstance(metadata, dict)
        with self._as(msg):
            return {"path": path, "metadata": replace(path, metadata, path)}
