"""Whether `pal vm exec` was given input on stdin that it would drop.

Exec does not pass stdin to the command yet (processes with stdin come later), so
``echo 'echo hi' | pal vm exec VM -- /bin/sh`` used to run a shell with no input, print
nothing and exit 0. Refusing is better than losing input silently; but a script or CI job
whose stdin is merely *there* must keep working: a terminal, /dev/null, a closed stdin,
an empty file, a pipe already at its end, and a pipe nobody has written to (a CI runner's
idle stdin: waiting for it would hang) all run the command.
"""

from __future__ import annotations

import os
import select
import stat
import sys


def piped_input(fd: int = 0) -> str | None:
    """What is waiting on ``fd`` that exec would drop ("a pipe", "a file"), or None.

    May consume a byte of a pipe; the caller refuses to run when this is not None."""
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
        return "a file" if st.st_size > offset else None
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        readable, _, _ = select.select([fd], [], [], 0)
        if not readable:
            return None  # nothing written (yet): an idle stdin, not input
        try:
            data = os.read(fd, 1)
        except OSError:
            return None
        return "a pipe" if data else None  # b"": the writer closed without writing
    return None
