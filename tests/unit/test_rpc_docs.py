"""The node RPC as docs/internals.md describes it: its table names every verb declared in
pal/wire/verbs.py (and no route it does not serve) and every field of each call's body and
result models (and no field they lack), and every id in a route's path is checked (a
SafeId) before any work."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from pal.ids import ID_PATTERN
from pal.wire import http, models
from pal.wire.verbs import VERBS, Call, Stream, Tunnel

REPO = Path(__file__).resolve().parents[2]
# A table row's first cell: | `METHOD /path?query` ...
ROW = re.compile(r"^\| `(GET|POST|PUT|DELETE) (/[^`?\s]*)")


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", path)


def _served() -> set[tuple[str, str]]:
    return {("GET" if isinstance(v, Tunnel) else v.method, _shape(v.path)) for v in VERBS}


def _documented() -> set[tuple[str, str]]:
    text = (REPO / "docs/internals.md").read_text()
    section = text.split("## Runtime manager RPC", 1)[1].split("\n## ", 1)[0]
    return {(m.group(1), _shape(m.group(2))) for line in section.splitlines() if (m := ROW.match(line))}


def test_the_rpc_table_lists_every_route_and_only_those() -> None:
    served, documented = _served(), _documented()
    assert served - documented == set(), "RPC routes missing from docs/internals.md"
    assert documented - served == set(), "docs/internals.md lists RPC routes that do not exist"


def test_every_id_in_an_rpc_path_is_checked() -> None:
    unchecked = []
    for v in VERBS:
        fields = {f.alias or n: f for n, f in v.request.model_fields.items()}
        for name in http.path_names(v.path):
            patterns = [getattr(m, "pattern", None) for m in fields[name].metadata]
            if name.endswith("Id") and name != "contextId" and ID_PATTERN not in patterns:
                unchecked.append(f"{v.path}: {name}")
    assert unchecked == [], "ids used unchecked (type them pal.ids.SafeId)"


# --- the fields of each call, as the table writes them, against pal/manager/models.py ---

CELL_SPLIT = re.compile(r"(?<!\\)\|")


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
        fields = {k: (_models_in(v) or [v])[0] if not isinstance(v, dict) else v for k, v in fields.items()}
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


def _body(verb: Call[Any, Any] | Stream[Any, Any]) -> dict[str, Any] | None:
    """The fields a verb's request carries in a JSON body (None: it has none)."""
    if verb.method in ("GET", "DELETE") or http.raw_field(verb.request) is not None:
        return None
    named = set(http.path_names(verb.path))
    fields = {f.alias or n: f.annotation for n, f in verb.request.model_fields.items()}
    return {k: a for k, a in fields.items() if k not in named} or None


def test_the_rpc_table_names_every_field_of_the_models_and_only_those() -> None:
    """Every JSON body is written out in full; so is every answer whose cell starts with
    its object (others are said in words: a stream's events, raw bytes)."""
    rows = _documented_fields()
    drift = []
    for verb in VERBS:
        if isinstance(verb, Tunnel):
            continue
        call = (verb.method, _shape(verb.path))
        body = _body(verb)
        if body is not None:
            doc = _doc_object(rows[call][0])
            assert doc is not None, f"{call}: the table gives no body for a call that takes {body}"
            drift += _drift(f"{' '.join(call)} body", doc, body)
        result = _doc_object(rows[call][1])
        if isinstance(verb, Call) and result is not None:
            drift += _drift(f"{' '.join(call)} result", result, verb.answer)
    assert drift == [], "the RPC table drifted from pal/wire's models:\n" + "\n".join(drift)


def test_the_field_list_parser_reads_nesting_and_values() -> None:
    doc = _doc_object('`{a, b?, c: {d, e: [{f}]}, g: "x"|"y", h: [id...]}`: more text')
    assert doc == {"a": None, "b": None, "c": {"d": None, "e": {"f": None}}, "g": None, "h": None}
    drift = _drift("x", {"bogus": None}, models.EgressSetResult)
    assert drift == ["x: `closed` is not documented", "x: `bogus` is documented but does not exist"]
