"""One contract, three SDKs: the scenarios of sdk/contract/scenarios.json run against one
real `pal up` (real microVMs) by each SDK's own test runner: pytest for Python (here, from
sdk_contract_py.py), `go vet` + `go test` for Go (sdk/go/contract_test.go) and `node --test`
for TypeScript (sdk/typescript/contract/). Each runner uses a tenant of its own with the
file's quota, schedules one VM and forks one child, so the added time stays small. The
README's Go and TypeScript examples run in tests/e2e/test_readme.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.sdk import Client, PalApiError
from tests.conftest import REPO, PalServer
from tests.e2e import sdk_contract_py
from tests.gosdk import go_env

pytestmark = pytest.mark.vm

CONTRACT = sdk_contract_py.load()
ACTIVE = [s["id"] for s in CONTRACT["scenarios"] if s["status"] == "active"]
TODO = [s["id"] for s in CONTRACT["scenarios"] if s["status"] == "todo"]
GO_SDK = REPO / "sdk" / "go"
TS_SDK = REPO / "sdk" / "typescript"


def _tenant(server: PalServer, name: str) -> str:
    return server.tenant(name, max_vms=int(CONTRACT["tenantMaxVms"]))


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    full_env = {**os.environ, **env}
    res = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=1200, env=full_env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(args)} failed ({res.returncode}):\n{out}"
    return out


@pytest.fixture(scope="module")
def py_state(pal_server: PalServer, tenant_key: str) -> Iterator[sdk_contract_py.State]:
    del tenant_key  # the warm template exists
    with Client(pal_server.url, _tenant(pal_server, "contract-python"), timeout=300) as c:
        st = sdk_contract_py.State(c)
        yield st
        if st.vm:
            try:
                c.runtime.delete(st.vm)
            except PalApiError:
                pass


def test_every_active_scenario_has_a_python_implementation() -> None:
    assert sorted(sdk_contract_py.SCENARIOS) == sorted(ACTIVE)


@pytest.mark.parametrize("scenario", [s["id"] for s in CONTRACT["scenarios"]])
def test_python_contract(scenario: str, py_state: sdk_contract_py.State) -> None:
    if scenario in TODO:
        pytest.skip(next(s["note"] for s in CONTRACT["scenarios"] if s["id"] == scenario))
    sdk_contract_py.SCENARIOS[scenario](py_state)


def test_go_contract(pal_server: PalServer, tenant_key: str) -> None:
    del tenant_key
    env = {**go_env(), "PAL_CONTRACT": "1", "PAL_URL": pal_server.url}
    env["PAL_API_KEY"] = _tenant(pal_server, "contract-go")
    _run(["go", "vet", "./..."], GO_SDK, env)
    out = _run(["go", "test", "-count=1", "-v", "-run", "^TestContract$", "./..."], GO_SDK, env)
    print(out)
    passed = re.findall(r"--- PASS: TestContract/(\S+)", out)
    skipped = re.findall(r"--- SKIP: TestContract/(\S+)", out)
    assert passed == ACTIVE and skipped == TODO, out


def test_typescript_contract(pal_server: PalServer, tenant_key: str) -> None:
    del tenant_key
    if not shutil.which("node") or not (TS_SDK / "node_modules" / ".bin" / "tsc").exists():
        pytest.fail("node and the SDK's dev packages are missing: run scripts/install.sh")
    _run(["npm", "run", "-s", "build"], TS_SDK, {})
    env = {"PAL_URL": pal_server.url, "PAL_API_KEY": _tenant(pal_server, "contract-typescript")}
    out = _run(["node", "--test", "--test-reporter=spec", "contract/"], TS_SDK, env)
    print(out)
    counts = {k: int(n) for k, n in re.findall(r"^ℹ (pass|fail|skipped|cancelled) (\d+)$", out, re.M)}
    assert counts == {"pass": len(ACTIVE), "fail": 0, "skipped": len(TODO), "cancelled": 0}, out
    for sid in ACTIVE:
        assert re.search(rf"^✔ {re.escape(sid)} \(", out, re.M), f"{sid} did not pass:\n{out}"
