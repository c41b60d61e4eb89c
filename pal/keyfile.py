"""Host key files: random secrets Pal keeps on disk, root's and 0600 in a 0700 directory.

Used for the snapshot metadata HMAC key (``PAL_SNAPSHOT_KEY_FILE``), the key that
encrypts secrets in the store (``PAL_SECRETS_KEY_FILE``) and the operator's token (text, so
an operator can ``cat`` it into a header: pal/operator.py). A missing file is created with
fresh random bytes (exclusively, so two processes starting together agree on one key); an
existing one is read as is, so a cluster shares a key by giving every host the same file.
The bottom of the stack: imports nothing from ``pal`` but the error types.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from pal.errors import Unavailable

KEY_BYTES = 32


def load_or_create(path: Path, size: int = KEY_BYTES) -> bytes:
    """The key in ``path`` (``size`` random bytes, created 0600 if missing).

    Refuses (503) a key of the wrong length, and a key file any other user may read or
    write (someone else could then forge snapshots or read secrets)."""
    _create(path, lambda: secrets.token_bytes(size))
    key = _read_private(path)
    if len(key) != size:
        raise Unavailable(f"key file {path} holds {len(key)} bytes, not {size}")
    return key


def load_or_create_token(path: Path) -> str:
    """The bearer token in ``path`` (URL-safe text, created 0600 if missing), with the same
    checks as :func:`load_or_create`; refuses one shorter than ``KEY_BYTES`` characters."""
    _create(path, lambda: (secrets.token_urlsafe(KEY_BYTES) + "\n").encode())
    token = _read_private(path).decode("ascii", "replace").strip()
    if len(token) < KEY_BYTES or not token.isprintable() or " " in token:
        raise Unavailable(f"token file {path} does not hold a token of at least {KEY_BYTES} characters")
    return token


def _create(path: Path, make: Callable[[], bytes]) -> None:
    """Write ``make()`` to ``path`` if it does not exist (exclusively: two processes
    starting together agree on one)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    try:
        os.write(fd, make())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    os.close(fd)


def _read_private(path: Path) -> bytes:
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise Unavailable(f"key file {path} is accessible to other users: chmod 600 it")
    if st.st_uid != os.geteuid():
        raise Unavailable(f"key file {path} belongs to uid {st.st_uid}, not to this process's user")
    return path.read_bytes()
