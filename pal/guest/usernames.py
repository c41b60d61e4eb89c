"""The workload user under another name (the ``urename`` request): E2B's conventions
(pal/e2b/conventions.py) want uid 1000 to be ``user`` with home ``/home/user``, its home
Pal's workspace. Done here, in the harness (root, PID 1), with no process: passwd, group
and their shadows rewritten in place, the home a bind mount of the workspace. Idempotent:
a fork or a resumed VM has it already (memory and disk both carry it)."""

from __future__ import annotations

import ctypes
import os
import re

from pal.guest import protocol as P
from pal.guest.errors import ExecError
from pal.guest.oslib import libc

NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
HOME = re.compile(r"^(/[A-Za-z0-9._-]+)+$")
MS_BIND = 4096
FILES = ("passwd", "group", "shadow", "gshadow")


def _renamed(path: str, line: str, old: str, new: str, uid: int, gid: int, home: str) -> str:
    f = line.split(":")
    if path.endswith("/passwd") and len(f) >= 7 and f[2] == str(uid):
        f[0], f[5] = new, home
    elif path.endswith("/group") and len(f) >= 3 and f[2] == str(gid):
        f[0] = new
    elif f[0] == old and old:
        f[0] = new
    return ":".join(f)


def _rewrite(path: str, old: str, new: str, uid: int, gid: int, home: str) -> bool:
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return False
    lines = [_renamed(path, ln, old, new, uid, gid, home) for ln in text.split("\n")]
    out = "\n".join(lines)
    if out == text:
        return False
    st = os.stat(path)
    tmp = path + ".pal-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, st.st_mode & 0o7777)
    with os.fdopen(fd, "w") as fh:
        fh.write(out)
    os.chown(tmp, st.st_uid, st.st_gid)
    os.chmod(tmp, st.st_mode & 0o7777)
    os.replace(tmp, path)
    return True


def _mounted(path: str) -> bool:
    with open("/proc/self/mounts") as fh:
        return any(line.split(" ")[1:2] == [path] for line in fh)


def rename_entries(etc: str, uid: int, gid: int, name: str, home: str) -> bool:
    """uid's passwd entry (and its shadow's), gid's group entry (and its gshadow's) under
    ``etc`` take ``name``, the passwd entry home ``home``; whether a file changed."""
    old = ""
    with open(os.path.join(etc, "passwd")) as fh:
        for line in fh:
            f = line.split(":")
            if len(f) >= 7 and f[2] == str(uid):
                old = f[0]
                break
    changed = False
    for path in FILES:
        changed = _rewrite(os.path.join(etc, path), old, name, uid, gid, home) or changed
    return changed


def rename_workload_user(uid: int, gid: int, msg: P.Message, workspace: str) -> P.Message:
    """``urename {name, home}`` -> ok {name, home, changed}: uid ``uid`` is ``name`` with
    home ``home``, and ``home`` shows the workspace."""
    name, home = msg.get("name"), msg.get("home")
    if not isinstance(name, str) or not NAME.match(name):
        raise ExecError(P.ERR_INVAL, "name must be a user name ([a-z_][a-z0-9_-]*, at most 32)")
    if not isinstance(home, str) or not HOME.match(home) or os.path.normpath(home) != home:
        raise ExecError(P.ERR_INVAL, "home must be a normalised absolute path")
    changed = rename_entries("/etc", uid, gid, name, home)
    if not _mounted(home):
        os.makedirs(home, exist_ok=True)
        if libc().mount(workspace.encode(), home.encode(), None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), home)
        changed = True
    return {"name": name, "home": home, "changed": changed}
