"""`pal vm exec`'s stdin check (pal/cli/stdin.py) on real descriptors: input waiting in a
pipe or a file is found; a stdin with nothing in it (/dev/null, an empty file, a pipe at its
end, a pipe nobody writes to, as under CI) is not, and the check never blocks."""

from __future__ import annotations

import os
from pathlib import Path

from pal.cli.stdin import piped_input


def test_a_pipe_with_data_is_input() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b"echo hi\n")
        assert piped_input(r) == "a pipe"
    finally:
        os.close(r)
        os.close(w)


def test_a_pipe_at_its_end_or_never_written_is_not() -> None:
    r, w = os.pipe()
    try:
        assert piped_input(r) is None  # the writer is open but silent: no wait, no input
        os.close(w)
        w = -1
        assert piped_input(r) is None  # closed without writing
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_file_with_unread_bytes_is_input(tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_bytes(b"echo hi\n")
    with script.open("rb") as f:
        assert piped_input(f.fileno()) == "a file"
        f.read()  # everything already read: nothing left to drop
        assert piped_input(f.fileno()) is None
    (tmp_path / "empty").write_bytes(b"")
    with (tmp_path / "empty").open("rb") as f:
        assert piped_input(f.fileno()) is None


def test_dev_null_and_a_closed_descriptor_are_not() -> None:
    with open(os.devnull, "rb") as f:
        assert piped_input(f.fileno()) is None
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    assert piped_input(r) is None
