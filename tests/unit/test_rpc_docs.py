"""The runtime manager's RPC as docs/internals.md describes it: its table names every route
the RPC app serves (and no route it does not), and every id in a route's path is checked
(a SafeId) before any work."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.routing import APIRoute, APIWebSocketRoute

from pal.ids import ID_PATTERN
from pal.manager.rpc import create_rpc_app

REPO = Path(__file__).resolve().parents[2]
# A table row's first cell: | `METHOD /path?query` ...
ROW = re.compile(r"^\| `(GET|POST|PUT|DELETE) (/[^`?\s]*)")


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", path)


def _served() -> set[tuple[str, str]]:
    app = create_rpc_app(object())  # type: ignore[arg-type]  (routes only; nothing is called)
    out = set()
    for r in app.routes:
        if isinstance(r, APIRoute):
            out |= {(m, _shape(r.path)) for m in r.methods}
        elif isinstance(r, APIWebSocketRoute):
            out.add(("GET", _shape(r.path)))
    return out


def _documented() -> set[tuple[str, str]]:
    text = (REPO / "docs/internals.md").read_text()
    section = text.split("## Runtime manager RPC", 1)[1].split("\n## ", 1)[0]
    return {(m.group(1), _shape(m.group(2))) for line in section.splitlines() if (m := ROW.match(line))}


def test_the_rpc_table_lists_every_route_and_only_those() -> None:
    served, documented = _served(), _documented()
    assert served - documented == set(), "RPC routes missing from docs/internals.md"
    assert documented - served == set(), "docs/internals.md lists RPC routes that do not exist"


def test_every_id_in_an_rpc_path_is_checked() -> None:
    app = create_rpc_app(object())  # type: ignore[arg-type]
    unchecked = []
    for r in app.routes:
        for p in getattr(getattr(r, "dependant", None), "path_params", []):
            patterns = [getattr(m, "pattern", None) for m in p.field_info.metadata]
            if p.name.endswith("_id") and ID_PATTERN not in patterns:
                unchecked.append(f"{r.path}: {p.name}")  # type: ignore[attr-defined]
    assert unchecked == [], "ids used unchecked (type them pal.ids.SafeId)"
