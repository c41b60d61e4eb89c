"""`pal --help` reads like `docker` or `gh` (issue 28): no ``<bool>``/``<str>`` type hints,
arguments in capitals (``VM``, not ``{vm_id}``), and examples. The real `pal` process, as a
user runs it (no server needed for help)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

HELPS = [
    (),
    ("vm",),
    ("vm", "exec"),
    ("vm", "schedule"),
    ("vm", "pause"),
    ("files",),
    ("files", "get"),
    ("tenants", "create"),
    ("up",),
]


def help_of(*args: str) -> str:
    res = subprocess.run(
        [str(Path(sys.executable).parent / "pal"), *args, "--help"],  # the installed entry point
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("args", HELPS, ids=lambda a: " ".join(a) or "pal")
def test_help_has_no_type_hints_and_no_braced_names(args: tuple[str, ...]) -> None:
    text = help_of(*args)
    assert "Usage: pal" in text, text
    assert not re.search(r"<(bool|str|int|float|list\[\w+\]|Path)>", text), text
    assert not re.search(r"\{[a-z_]+\}", text), text  # usage reads VM, not {vm_id}
    assert "--help" in text


def test_usage_names_arguments_in_capitals() -> None:
    text = help_of("vm", "exec")
    assert re.search(r"Usage: pal vm exec \[OPTIONS\] VM COMMAND\.\.\.", text), text
    assert re.search(r"--timeout\s+SECS", text), text  # a value option says what it takes
    assert re.search(r"--stream\s+print output", text), text  # a flag takes nothing
    assert "Usage: pal files get [OPTIONS] VM PATH [LOCAL]" in help_of("files", "get")


@pytest.mark.parametrize("args", [(), ("vm",), ("vm", "exec"), ("vm", "schedule")], ids=" ".join)
def test_main_commands_show_examples(args: tuple[str, ...]) -> None:
    text = help_of(*args)
    assert "Examples:" in text, text
    examples = text.split("Examples:", 1)[1]
    assert re.search(r"^\s*(\S+=\$\()?pal \w+", examples, re.M), examples
