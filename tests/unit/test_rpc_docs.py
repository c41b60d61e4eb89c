"""The runtime manager's RPC as docs/internals.md describes it: its table names every route
the RPC app serves (and no route it does not) and every field of each call's body and result
models (and no field they lack), and every id in a route's path is checked (a SafeId)
before any work."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

from fastapi.routing import APIRoute, APIWebSocketRoute
from pydantic import BaseModel

from pal.ids import ID_PATTERN
from pal.manager import models
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


# --- the fields of each call, as the table writes them, against pal/manager/models.py ---

CELL_SPLIT = re.compile(r"(?<!\\)\|")
# Results the RPC app builds from a model (the handler's JSONResponse hides it from FastAPI):
# a model, or a wrapper object {key: [Model]} as the handler writes it.
RESULTS: dict[tuple[str, str], Any] = {
    ("POST", "/vms"): models.SpawnResult,
    ("POST", "/vms/{}/snapshot"): models.SnapshotResult,
    ("POST", "/vms/{}/live-pause"): models.LivePauseResult,
    ("POST", "/vms/{}/live-resume"): models.LiveResumeResult,
    ("GET", "/notices"): models.Notices,
    ("PUT", "/vms/{}/egress"): models.EgressSetResult,
    ("GET", "/egress/events"): models.EgressEvents,
    ("GET", "/vms/{}/files"): models.FileList,
    ("PUT", "/vms/{}/files/content"): models.FileWritten,
    ("DELETE", "/vms/{}/files/content"): models.FileDeleted,
    ("GET", "/vms/{}/metrics"): models.VmMetrics,
    ("GET", "/stats"): models.NodeStats,
    ("GET", "/snapshots/{}/{}"): {"snapshots": [models.SnapshotInfo]},
    ("GET", "/snapshots/{}/{}/{}"): models.SnapshotStatus,
    ("GET", "/snapshots"): models.SnapshotOwners,
    ("GET", "/images"): {"images": [models.ImageInfo]},
    ("POST", "/templates"): models.WarmResult,
    ("GET", "/heartbeat"): models.NodeHeartbeat,
}


def _object(text: str, i: int = 0) -> tuple[dict[str, Any], int]:
    """Parse ``{a, b?, c: {d}, e: [{f}], g: "x"|"y"}`` from text[i] == "{": key -> nested
    object (a dict) or None (a plain value). Returns the object and the index after it."""
    assert text[i] == "{"
    out: dict[str, Any] = {}
    i += 1
    while True:
        key = re.match(r"\s*(\w+)\??\s*", text[i:])
        assert key, f"not a field list: {text!r} at {i}"
        i += key.end()
        value: Any = None
        if text[i] == ":":
            i += 1
            while text[i] == " ":
                i += 1
            if text[i] == "{":
                value, i = _object(text, i)
            elif text.startswith("[{", i):
                value, i = _object(text, i + 1)
                assert text[i] == "]", text[i:]
                i += 1
            # anything else is a plain value written out ("auto"|"cold", [id...], null | state)
            depth = 0
            while depth or text[i] not in ",}":
                depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(text[i], 0)
                i += 1
        out[key.group(1)] = value
        if text[i] == "}":
            return out, i + 1
        i += 1  # ","


def _documented_fields() -> dict[tuple[str, str], tuple[str, str]]:
    """(method, path shape) -> (body cell, result cell) of the table."""
    text = (REPO / "docs/internals.md").read_text()
    section = text.split("## Runtime manager RPC", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if m := ROW.match(line):
            cells = [c.strip() for c in CELL_SPLIT.split(line)[1:-1]]
            rows[(m.group(1), _shape(m.group(2)))] = (cells[1], cells[2])
    return rows


def _doc_object(cell: str) -> dict[str, Any] | None:
    m = re.match(r"`(\{.*?)`", cell.replace("\\|", "|"))
    return _object(m.group(1))[0] if m else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def _drift(where: str, doc: dict[str, Any], shape: Any) -> list[str]:
    """How a documented object differs from the model (or wrapper) it describes."""
    if isinstance(shape, dict):
        fields = {k: v[0] if isinstance(v, list) else v for k, v in shape.items()}
    else:
        fields = {f.alias or name: f.annotation for name, f in shape.model_fields.items()}
    out = [f"{where}: `{k}` is not documented" for k in sorted(fields.keys() - doc.keys())]
    out += [f"{where}: `{k}` is documented but does not exist" for k in sorted(doc.keys() - fields.keys())]
    for key, nested in doc.items():
        if nested is None or key not in fields:
            continue
        inner = fields[key] if isinstance(shape, dict) else _models_in(fields[key])
        if isinstance(inner, list):
            if len(inner) != 1:
                continue  # a union of several models (an egress policy): written as a value
            inner = inner[0]
        out += _drift(f"{where}.{key}", nested, inner)
    return out


def _bodies() -> dict[tuple[str, str], type[BaseModel]]:
    app = create_rpc_app(object())  # type: ignore[arg-type]
    out = {}
    for r in app.routes:
        if isinstance(r, APIRoute) and r.body_field is not None:
            for m in r.methods:
                out[(m, _shape(r.path))] = r.body_field.field_info.annotation
    return out


def test_the_rpc_table_names_every_field_of_the_models_and_only_those() -> None:
    rows = _documented_fields()
    assert RESULTS.keys() <= rows.keys(), "RESULTS names a call the table does not list"
    drift = []
    for call, model in _bodies().items():
        doc = _doc_object(rows[call][0])
        assert doc is not None, f"{call}: the table gives no body for a call that takes {model.__name__}"
        drift += _drift(f"{' '.join(call)} body", doc, model)
    for call, shape in RESULTS.items():
        doc = _doc_object(rows[call][1])
        assert doc is not None, f"{call}: the table gives no result object"
        drift += _drift(f"{' '.join(call)} result", doc, shape)
    assert drift == [], "the RPC table drifted from pal/manager/models.py:\n" + "\n".join(drift)


def test_the_field_list_parser_reads_nesting_and_values() -> None:
    doc = _doc_object('`{a, b?, c: {d, e: [{f}]}, g: "x"|"y", h: [id...]}`: more text')
    assert doc == {"a": None, "b": None, "c": {"d": None, "e": {"f": None}}, "g": None, "h": None}
    drift = _drift("x", {"bogus": None}, models.EgressSetResult)
    assert drift == ["x: `closed` is not documented", "x: `bogus` is documented but does not exist"]
