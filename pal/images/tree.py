"""Paths inside an unpacked image tree, resolved the way the guest will see them.

An image is untrusted input, and Pal edits its tree as root on the host (passwd, /workspace,
/.pal). A symlink in the image such as ``etc -> /etc`` or ``workspace -> ../../..`` must
resolve *inside the tree* (as it will in the guest), never to the host's files: every path
Pal writes to goes through :func:`in_root`. The tree is private to the build while we do
this, so nothing changes it between resolution and use.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pal.errors import InvalidRequest

MAX_LINKS = 40  # as the kernel's path walk


def in_root(root: Path, path: str, *, follow_last: bool = True) -> Path:
    """The host path of ``path`` in the tree at ``root``, symlinks resolved within the tree.

    Components that do not exist yet are kept as they are (the caller may create them).
    """
    root = Path(os.path.realpath(root))
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if not parts and not follow_last:
            resolved.append(part)
            break
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            resolved.append(part)
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise InvalidRequest(f"too many levels of symbolic links at /{'/'.join([*resolved, part])}")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        resolved.append(part)
    return root.joinpath(*resolved)


def is_executable_file(root: Path, path: str) -> bool:
    """Whether ``path`` resolves (in the tree) to an executable regular file."""
    real = in_root(root, path)
    try:
        st = os.stat(real, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)


def write_public(path: Path, text: str, mode: int = 0o644) -> None:
    """Write a file of the guest's system (passwd, hosts, resolv.conf...) with the mode the
    guest's users need, whatever the umask of the process building the image (Pal runs
    with 077: a file it makes would otherwise be root's alone inside the guest too)."""
    path.write_text(text)
    path.chmod(mode)


def make_public_dirs(path: Path) -> None:
    """``mkdir -p`` with every directory it makes 0755 (see :func:`write_public`)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir()
        d.chmod(0o755)
