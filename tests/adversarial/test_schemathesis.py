"""Every route of ``/openapi.json``, fuzzed by schemathesis: whatever a client sends, the
API never answers 5xx, and every answer conforms to the schema it documents (status code,
content type, body).

The app is the real API on the real Scheduler and store; the runtime manager is the fake
of tests/fakes.py (fast, so hypothesis can send hundreds of requests). Each generated case
is sent twice: as generated (mostly unknown ids: 404 paths), and with the path's VM id
replaced by a live VM of the caller's, so the bodies reach the scheduler's real checks.

One pytest test per operation, parametrized here by its label (``GET /v1/...``) rather
than by schemathesis's ``schema.parametrize()``: under pytest 9.2 the items that plugin
makes all get the function's bare node id, so a run counted 25 tests as one (the progress
counter ended at ``[ 98%]``, and ``-k``, ``--lf`` and reports could not tell them apart).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks

from pal.api.ports_openapi import PROXY_PATH
from tests.apienv import make_api

# Built at import: schemathesis makes one test per operation at collection time (its
# ``from_fixture`` does not work with this pytest).
_tmp = tempfile.TemporaryDirectory(prefix="pal-fuzz-")
# Room for the VMs the fuzzer schedules and forks: a full quota is a 402, which conforms
# too, but it would keep the schedule and fork bodies away from the scheduler's checks.
# "testserver": the host name of schemathesis's ASGI client (Starlette's TestClient).
API = make_api(Path(_tmp.name), max_vms=1000, hosts=("testserver",))
schema = schemathesis.openapi.from_asgi("/openapi.json", API.app)
# A query parameter a route does not declare is ignored, not refused (a newer client's
# parameter reaches an older server harmlessly), so the fuzzer sends only declared ones:
# with them, a route drew an extra `?=0` and the check called its 200 a negative accepted.
schema.config.generation.update(allow_extra_parameters=False)
# The ports proxy answers with whatever the guest's server sends (any status, any body), so
# neither the 5xx check nor the schema's conformance applies to it; its own tests are in
# tests/integration/test_ports.py. It is documented (checked below), not fuzzed.
NOT_FUZZED = {PROXY_PATH}
OPERATIONS = {
    op.label: op for op in (r.ok() for r in schema.get_all_operations()) if op.path not in NOT_FUZZED
}


# Checks that do not apply: a schema-valid body may still be refused with a 400 that names
# the rule (rules across fields, e.g. ``offload`` only with ``mode: live``, are not JSON
# Schema); and 405 answers carry Starlette's Allow header of the one route that matched.
NOT_APPLICABLE = [checks.positive_data_acceptance, checks.allow_header_conformance, checks.unsupported_method]
# Probes whose 503 is their documented answer (not healthy, not ready yet); their bodies
# are still checked against the schema.
PROBES = {"/healthz", "/readyz"}


@pytest.fixture(scope="module")
def live_vm() -> str:
    from starlette.testclient import TestClient

    with TestClient(API.app) as c:
        r = c.post("/v1/runtime/schedule", json={}, headers={"Authorization": f"Bearer {API.key_a}"})
        assert r.status_code == 200, r.text
        return str(r.json()["vmId"])


def cases(label: str) -> st.SearchStrategy[schemathesis.Case]:
    """What schemathesis generates for the operation: bodies, parameters and headers that
    fit its schema, and ones that do not."""
    op = OPERATIONS[label]
    return st.one_of(
        op.as_strategy(schemathesis.GenerationMode.POSITIVE),
        op.as_strategy(schemathesis.GenerationMode.NEGATIVE),
    )


@pytest.mark.parametrize("label", list(OPERATIONS))  # in the document's order, as before
def test_no_route_answers_5xx_or_off_its_schema(label: str, live_vm: str) -> None:
    headers = {"Authorization": f"Bearer {API.key_a}"}
    excluded = NOT_APPLICABLE
    if OPERATIONS[label].path in PROBES:
        excluded = [*excluded, not_a_server_error]

    @given(case=cases(label))
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=headers, excluded_checks=excluded)
        if "vm_id" in (case.path_parameters or {}):
            case.path_parameters = {**case.path_parameters, "vm_id": live_vm}
            case.call_and_validate(headers=headers, excluded_checks=excluded)

    fuzz()


def test_the_fuzzed_schema_covers_every_route() -> None:
    """A route left out of ``/openapi.json`` would be left out of the fuzzing too."""
    from starlette.routing import Route

    documented = set(API.app.openapi()["paths"])
    served = {
        r.path
        for r in API.app.routes
        if isinstance(r, Route) and r.include_in_schema and r.path.startswith(("/v1/", "/healthz", "/readyz"))
    }
    assert served <= documented, served - documented
    assert "/v1/runtime/schedule" in documented
    # The ports proxy is documented (it is not a FastAPI-documented route), for every
    # method OpenAPI can name; and each documented operation is one test, with its own id.
    proxy = API.app.openapi()["paths"][PROXY_PATH]
    assert set(proxy) == {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
    assert {p["name"] for p in proxy["post"]["parameters"]} == {"vm_id", "port", "path"}
    assert "*/*" in proxy["post"]["requestBody"]["content"]
    fuzzed = {(op.path, op.method.lower()) for op in OPERATIONS.values()}
    every = {(path, m) for path, item in API.app.openapi()["paths"].items() for m in item}
    assert every - fuzzed == {(PROXY_PATH, m) for m in proxy}, every - fuzzed
