"""An image's exec defaults (its OCI ``ENV``, ``WORKDIR``, ``USER``, ``CMD``), resolved once.

They are written into the image as ``/.pal/config.json`` (read by the harness at boot, so a
snapshot or template always carries the defaults of the image it was made from) and into
the image's meta.json (for `pal image ls` and `GET /v1/images`).

Rules (docs/images.md):
- ``USER`` set: that user is the *workload user*: execs run as it by default and the files
  API reads and writes /workspace as it. A name must exist in the image's /etc/passwd; a
  numeric uid need not (home ``/``, group 0, as Docker does).
- ``USER`` unset: the workload user is ``pal`` (uid 1000, or the first free uid from 1000),
  added to the image when it has none, so sandboxes do not run as root by default.
- ``WORKDIR``: the default working directory of execs (else /workspace).
- ``ENV``: every exec starts with it (PATH included), before secrets and the request's env.
- ``CMD`` / ``ENTRYPOINT``: recorded only; the harness is PID 1 and runs what it is asked.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pal.errors import InvalidRequest
from pal.guest import protocol as p
from pal.images.tree import in_root, is_executable_file, make_public_dirs, write_public

WORKLOAD_UID = 1000


@dataclass(frozen=True)
class ImageConfig:
    user: str = p.WORKLOAD_USER
    uid: int = WORKLOAD_UID
    gid: int = WORKLOAD_UID
    home: str = f"/home/{p.WORKLOAD_USER}"
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ImageConfig:
        if not data:
            return cls()
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


@dataclass(frozen=True)
class OciRunConfig:
    """The parts of an OCI image config Pal honours (``config`` in the config blob)."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None

    @classmethod
    def parse(cls, blob: dict[str, Any]) -> OciRunConfig:
        cfg = blob.get("config") or {}
        env: dict[str, str] = {}
        for item in cfg.get("Env") or []:
            if isinstance(item, str) and "=" in item:
                k, _, v = item.partition("=")
                if k and "\0" not in item:
                    env[k] = v
        return cls(
            env=env,
            workdir=cfg.get("WorkingDir") or None,
            user=cfg.get("User") or None,
            cmd=list(cfg["Cmd"]) if isinstance(cfg.get("Cmd"), list) else None,
            entrypoint=list(cfg["Entrypoint"]) if isinstance(cfg.get("Entrypoint"), list) else None,
        )


def _read_db(path: Path) -> list[list[str]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _passwd(root: Path) -> list[list[str]]:
    # Entries with non-numeric ids are ignored (as malformed lines are by libc).
    return [
        e for e in _read_db(in_root(root, "etc/passwd")) if len(e) >= 7 and e[2].isdigit() and e[3].isdigit()
    ]


def _group(root: Path) -> list[list[str]]:
    return [e for e in _read_db(in_root(root, "etc/group")) if len(e) >= 3 and e[2].isdigit()]


def add_user(root: Path, name: str, uid: int | None = None) -> tuple[int, int, str]:
    """Add ``name`` (with a group of its own) to the image's passwd/group files unless it
    exists; returns (uid, gid, home). Edits the files directly: no chroot'd useradd, so it
    works in any image, even one with no shadow tools or no /etc at all."""
    for e in _passwd(root):
        if e[0] == name:
            return int(e[2]), int(e[3]), e[5]
    used_uids = {int(e[2]) for e in _passwd(root)}
    used_gids = {int(e[2]) for e in _group(root)}
    if uid is None or uid in used_uids or uid in used_gids:
        uid = WORKLOAD_UID
        while uid in used_uids or uid in used_gids:
            uid += 1
    home = f"/home/{name}"
    shell = "/bin/bash" if is_executable_file(root, "bin/bash") else "/bin/sh"
    make_public_dirs(in_root(root, "etc"))
    passwd, group, shadow = (in_root(root, f"etc/{n}") for n in ("passwd", "group", "shadow"))
    if not passwd.exists():
        write_public(passwd, "root:x:0:0:root:/root:/bin/sh\n")
    if not group.exists():
        write_public(group, "root:x:0:\n")
    for path, line in (
        (passwd, f"{name}:x:{uid}:{uid}:Pal workload:{home}:{shell}\n"),
        (group, f"{name}:x:{uid}:\n"),
    ):
        text = path.read_text()
        # Readable by every user of the guest (id, ls -l, getpwuid), as in any Linux.
        write_public(path, text + ("" if not text or text.endswith("\n") else "\n") + line)
    if shadow.exists():
        with shadow.open("a") as f:
            f.write(f"{name}:!:19000:0:99999:7:::\n")
    return uid, uid, home


def resolve(root: Path, run: OciRunConfig) -> ImageConfig:
    """The exec defaults of the tree at ``root`` (adds the ``pal`` user when USER is unset)."""
    if run.workdir is not None and not run.workdir.startswith("/"):
        raise InvalidRequest(f"image WORKDIR {run.workdir!r} is not an absolute path")
    common: dict[str, Any] = {
        "env": dict(run.env),
        "workdir": os.path.normpath(run.workdir) if run.workdir else None,
        "cmd": run.cmd,
        "entrypoint": run.entrypoint,
    }
    if run.user is None:
        uid, gid, home = add_user(root, p.WORKLOAD_USER, WORKLOAD_UID)
        return ImageConfig(user=p.WORKLOAD_USER, uid=uid, gid=gid, home=home, **common)
    user, _, group = run.user.partition(":")
    entry = next((e for e in _passwd(root) if e[0] == user or (user.isdigit() and e[2] == user)), None)
    if entry is not None:
        name, uid, gid, home = entry[0], int(entry[2]), int(entry[3]), entry[5] or "/"
    elif user.isdigit():
        name, uid, gid, home = user, int(user), 0, "/"
    else:
        raise InvalidRequest(f"image USER {user!r} is not in the image's /etc/passwd")
    if group:
        g = next((e for e in _group(root) if e[0] == group or e[2] == group), None)
        if g is not None:
            gid = int(g[2])
        elif group.isdigit():
            gid = int(group)
        else:
            raise InvalidRequest(f"image USER group {group!r} is not in the image's /etc/group")
    return ImageConfig(user=name, uid=uid, gid=gid, home=home, **common)
