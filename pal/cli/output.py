"""How the CLI prints: results as JSON on stdout (scriptable), or plain aligned tables on
request; errors as one human-readable line on stderr, or as JSON with the global
``--json`` flag; exit status 1 on an error."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from pal.sdk import PalApiError

T = TypeVar("T")
err_console = Console(stderr=True)  # progress bars and notes of long server-side commands


# The --table flag of every listing command.
Table = Annotated[bool, typer.Option("--table", help="aligned columns instead of JSON")]


class _Mode:
    json_errors = False  # set by the `pal --json` callback


mode = _Mode()


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Aligned columns, never cut or wrapped (ids stay whole, so they can be copied)."""
    cells = [[("" if row.get(c) is None else str(row.get(c))) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    for line in [list(columns), *cells]:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def print_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str], table: bool) -> None:
    """A list command's answer: aligned ``columns`` with ``--table``, else the rows as JSON."""
    if table:
        print_table(rows, columns)
    else:
        print_json(rows)


def note(message: str) -> None:
    """A remark on stderr that is not an error (truncation, timeouts...)."""
    sys.stderr.write(f"pal: {message}\n")


def fail(message: str, code: str = "ERROR", status: int = 1) -> NoReturn:
    if mode.json_errors:
        sys.stderr.write(json.dumps({"error": {"code": code, "message": message}}) + "\n")
    else:
        sys.stderr.write(f"pal: error: {message} ({code})\n")
    raise typer.Exit(status)


def read_local(local: Path | None) -> bytes:
    """A local file's bytes, or stdin's when ``local`` is None or ``-`` (what a put writes)."""
    if local is None or str(local) == "-":
        return sys.stdin.buffer.read()
    try:
        return local.read_bytes()
    except OSError as exc:
        fail(f"cannot read {local}: {exc.strerror or exc}", "LOCAL_FILE")


@contextmanager
def api_errors() -> Iterator[None]:
    """Turn SDK errors into an error line on stderr and exit status 1."""
    try:
        yield
    except PalApiError as exc:
        fail(exc.message, exc.code)


def call(fn: Callable[[], T]) -> T:
    with api_errors():
        return fn()
    raise AssertionError("unreachable")


def parse_pairs(pairs: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in pairs or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{what} must look like KEY=VALUE, got {item!r}")
        out[key] = value
    return out
