"""Whether `pal vm exec` was given input on stdin to pass to the command.

``echo 'echo hi' | pal vm exec VM -- /bin/sh`` runs the command as a process with its
stdin open and hands it our stdin (pal/cli/vm_processes.py). A script or CI job whose
stdin is merely *there* runs the command without stdin, as before: a terminal,
/dev/null, a closed stdin, an empty file, a pipe already at its end, and a pipe nobody
has written to (a CI runner's idle stdin: waiting for it would hang).
"""

from __future__ import annotations

import os
import select
import stat
import sys


def piped_input(fd: int = 0) -> str | None:
    """What is waiting on ``fd`` ("a pipe", "a file"), or None. May consume a byte of a
    pipe (:func:`pending_input` keeps it)."""
    got = pending_input(fd)
    return None if got is None else got[0]


def pending_input(fd: int = 0) -> tuple[str, bytes] | None:
    """("a pipe" | "a file", the bytes already read from it to find out), or None when
    nothing is waiting on ``fd``."""
    if fd == 0 and sys.stdin is None:
        return None  # closed when Python started (fd 0 may since belong to another file)
    try:
        st = os.fstat(fd)
    except OSError:
        return None  # closed
    if os.isatty(fd) or stat.S_ISCHR(st.st_mode):
        return None  # a terminal or /dev/null: nothing was piped in
    if stat.S_ISREG(st.st_mode):
        try:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:
            offset = 0
        return ("a file", b"") if st.st_size > offset else None
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        readable, _, _ = select.select([fd], [], [], 0)
        if not readable:
            return None  # nothing written (yet): an idle stdin, not input
        try:
            data = os.read(fd, 1)
        except OSError:
            return None
        return ("a pipe", data) if data else None  # b"": the writer closed without writing
    return None
