"""Each error status is stated once, with its code, on its class in pal/errors.py; the API's
HTTP-exception codes, the OpenAPI error responses and the manager RPC's rebuild agree."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import pal
from pal import errors
from pal.api.errors import _DESCRIPTIONS, _HTTP_CODES
from pal.api.openapi import document
from pal.errors import BY_STATUS, PalError, from_wire


def _all_error_classes() -> list[type[PalError]]:
    for mod in pkgutil.walk_packages(pal.__path__, "pal."):
        if mod.name.startswith(
            ("pal.guest", "pal_tools.bench", "pal.sdk", "pal.store.migrations")
        ) or mod.name.endswith("__main__"):
            continue
        importlib.import_module(mod.name)
    seen, todo = [], [PalError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_one_class_states_each_status() -> None:
    assert sorted(BY_STATUS) == [400, 401, 402, 403, 404, 409, 413, 415, 429, 500, 502, 503, 504, 507]
    for status, cls in BY_STATUS.items():
        assert cls.__module__ == errors.__name__ and cls.__bases__ == (PalError,)
        assert cls.status == status and cls.code and cls.summary


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_error_keeps_a_stated_status_and_crosses_the_rpc_whole(cls: type[PalError]) -> None:
    assert cls is PalError or cls.status in BY_STATUS, f"{cls.__name__}: status {cls.status} has no class"
    back = from_wire(cls.status, cls.code, "m")
    assert (back.status, back.code, back.message) == (cls.status, cls.code, "m")
    if cls is not PalError:
        assert isinstance(back, BY_STATUS[cls.status])


def test_http_exceptions_answer_the_stated_codes() -> None:
    for status, cls in BY_STATUS.items():
        assert _HTTP_CODES[status] == cls.code
        assert _DESCRIPTIONS[status] == cls.summary


def test_the_openapi_error_responses_are_the_stated_ones() -> None:
    doc = document()
    seen = set()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for key, response in op.get("responses", {}).items():
                schema = response.get("content", {}).get("application/json", {}).get("schema")
                if schema != {"$ref": "#/components/schemas/ErrorOut"}:
                    continue  # a success, or a health answer's own shape
                status, where = int(key), f"{method.upper()} {path} {key}"
                seen.add(status)
                assert status in BY_STATUS, f"{where}: no error class states this status"
                if not (op.get("tags") == ["ports"] and status == 502):  # the proxy says more
                    assert response["description"] == BY_STATUS[status].summary, where
    assert {400, 401, 404, 409, 503} <= seen
