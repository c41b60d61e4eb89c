"""How a verb (verbs.py) travels over HTTP: the one rule both the node's server
(pal/manager/rpc.py) and the control plane's client (pal/scheduler/node_client.py) follow.

- The route's path is made of the request's fields it names (``{vmId}``), by wire name.
- A request's other fields go in the query string for GET and DELETE (a list field
  repeated), in a JSON body for POST and PUT. A ``bytes`` field (a file, stdin) is the raw
  body instead, its other fields in the query.
- An answer is its model as JSON; one with a ``bytes`` field is that field raw, its other
  fields as JSON in the ``X-Pal-Fields`` header.
- A stream is NDJSON, one event a line. An error of the node after it started is an
  ``error`` line with its ``status`` (the caller raises it again as that PalError); an
  ``error`` line without one is the guest's, which the caller maps (guest_errors.py).
- An error is ``{"error": {code, message}}`` with the status the API should answer.

Every id is validated by the request's model (``SafeId``) before any work: 400 otherwise.
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from pal.errors import InvalidRequest, PalError, from_wire
from pal.wire.verbs import Call, Stream, Tunnel

JSON = "application/json"
NDJSON = "application/x-ndjson"
RAW = "application/octet-stream"
FIELDS_HEADER = "X-Pal-Fields"
_NAMES = re.compile(r"\{(\w+)\}")

AnyVerb = Call[Any, Any] | Stream[Any, Any] | Tunnel[Any]


def _method(verb: AnyVerb) -> str:
    return "GET" if isinstance(verb, Tunnel) else verb.method


_RAW: dict[type[BaseModel], str | None] = {}
_LISTS: dict[type[BaseModel], frozenset[str]] = {}


def raw_field(model: type[BaseModel]) -> str | None:
    """The model's ``bytes`` field (at most one), which travels as the raw body."""
    if model not in _RAW:
        _RAW[model] = next((n for n, f in model.model_fields.items() if f.annotation is bytes), None)
    return _RAW[model]


def _list_fields(model: type[BaseModel]) -> frozenset[str]:
    if model not in _LISTS:
        fields = model.model_fields.items()
        _LISTS[model] = frozenset(f.alias or n for n, f in fields if typing.get_origin(f.annotation) is list)
    return _LISTS[model]


def path_names(path: str) -> list[str]:
    return _NAMES.findall(path)


@dataclass(frozen=True)
class Encoded:
    """A request as it goes out: its path, query, and JSON or raw body."""

    method: str
    path: str
    params: dict[str, Any]
    json: dict[str, Any] | None = None
    content: bytes | None = None


def encode_request(verb: AnyVerb, req: BaseModel) -> Encoded:
    raw = raw_field(type(req))
    fields = req.model_dump(by_alias=True, mode="json", exclude={raw} if raw else None)
    path = verb.path.format(**{n: quote(str(fields.pop(n)), safe="") for n in path_names(verb.path)})
    method = _method(verb)
    if raw is not None or method in ("GET", "DELETE"):
        params = {k: v for k, v in fields.items() if v is not None}
        return Encoded(method, path, params, content=getattr(req, raw) if raw else None)
    return Encoded(method, path, {}, json=fields)


def decode_request(
    verb: AnyVerb,
    path_params: dict[str, str],
    query: list[tuple[str, str]],
    body: bytes,
) -> Any:
    """The verb's request from what came in; 400 for anything its model refuses."""
    model = verb.request
    data: dict[str, Any] = {}
    raw = raw_field(model)
    if raw is not None or _method(verb) in ("GET", "DELETE"):
        lists = _list_fields(model)
        for key, value in query:
            if key in lists:
                data.setdefault(key, []).append(value)
            else:
                data[key] = value
        if raw is not None:
            data[raw] = body
    elif body:
        try:
            parsed = json.loads(body)
        except ValueError:
            raise InvalidRequest("invalid manager request: the body is not JSON") from None
        if not isinstance(parsed, dict):
            raise InvalidRequest("invalid manager request: the body is not an object")
        data.update(parsed)
    data.update(path_params)
    try:
        return model.model_validate(data, strict=False)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid manager request: {_where(exc)}") from None


def _where(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()[:5]
    )


def encode_answer(ans: BaseModel) -> tuple[bytes, str, dict[str, str]]:
    """(body, media type, headers) of an answer."""
    raw = raw_field(type(ans))
    if raw is not None:
        rest = ans.model_dump(by_alias=True, mode="json", exclude={raw})
        return getattr(ans, raw), RAW, {FIELDS_HEADER: json.dumps(rest)}
    return json.dumps(ans.model_dump(by_alias=True, mode="json")).encode(), JSON, {}


def decode_answer(verb: Call[Any, Any], headers: typing.Mapping[str, str], content: bytes) -> Any:
    raw = raw_field(verb.answer)
    if raw is not None:
        fields = json.loads(headers.get(FIELDS_HEADER) or "{}")
        return verb.answer.model_validate({**fields, raw: content})
    return verb.answer.model_validate_json(content)


def error_of(status: int, content: bytes) -> PalError:
    """The PalError an error answer carries (one without a body: its status alone)."""
    try:
        err = json.loads(content)["error"]
        return from_wire(status, err["code"], err["message"])
    except (ValueError, KeyError, TypeError):
        return PalError(f"runtime manager answered {status}: {content[:200]!r}")


def event_line(ev: BaseModel) -> bytes:
    return (ev.model_dump_json(by_alias=True, exclude_none=True) + "\n").encode()


def error_line(exc: PalError) -> bytes:
    """A node-side error after the stream started: an ``error`` event with its status."""
    body = {"type": "error", "code": exc.code, "message": exc.message, "status": exc.status}
    return (json.dumps(body) + "\n").encode()


def decode_event(verb: Stream[Any, Any], line: str) -> Any:
    """One event of a stream; the node's own error (a ``status``) raised as its PalError."""
    raw = json.loads(line)
    if isinstance(raw, dict) and raw.get("type") == "error" and raw.get("status") is not None:
        raise from_wire(int(raw["status"]), str(raw.get("code") or ""), str(raw.get("message") or ""))
    return verb.event.model_validate(raw)
