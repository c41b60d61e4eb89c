"""How the CLI prints: JSON on stdout by default (scriptable), rich tables on request,
API errors as JSON on stderr with exit status 1."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from pal.sdk import PalApiError

T = TypeVar("T")
err_console = Console(stderr=True)


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str | None = None) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    Console().print(table)


def fail(message: str, code: str = "ERROR", status: int = 1) -> None:
    sys.stderr.write(json.dumps({"error": {"code": code, "message": message}}) + "\n")
    raise typer.Exit(status)


@contextmanager
def api_errors() -> Iterator[None]:
    """Turn SDK errors into a JSON error on stderr and exit status 1."""
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
