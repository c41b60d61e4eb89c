"""The TypeScript SDK (sdk/typescript) under Node's own test runner against a real `pal up`:
its generated types match the live server's /openapi.json, it compiles (tsc), and
`node --test` exercises every call, execStream's ordering and the error types."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, PalServer

pytestmark = pytest.mark.vm

SDK = REPO / "sdk" / "typescript"


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> str:
    res = subprocess.run(
        args, cwd=SDK, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(args)} failed ({res.returncode}):\n{out}"
    return out


@pytest.fixture(scope="module")
def built() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.fail("node and npm are missing: run scripts/install.sh (it installs them)")
    major = int(
        subprocess.run([node, "--version"], capture_output=True, text=True)
        .stdout.strip()
        .lstrip("v")
        .split(".")[0]
    )
    assert major >= 18, f"the SDK supports Node >= 18; this is {major}"
    stamp = SDK / "node_modules" / ".package-lock.json"
    if not stamp.exists() or stamp.stat().st_mtime < (SDK / "package-lock.json").stat().st_mtime:
        _run([npm, "ci", "--no-audit", "--no-fund"])
    _run([npm, "run", "-s", "check:types"])  # src/openapi.ts is what openapi.json generates
    _run([npm, "run", "-s", "build"])
    return SDK / "dist"


def test_sdk_types_come_from_the_live_servers_openapi(pal_server: PalServer, built: Path) -> None:
    live = httpx.get(pal_server.url + "/openapi.json", timeout=30).json()
    assert json.loads((SDK / "openapi.json").read_text()) == live, "run bash scripts/gen-ts-types.sh"
    assert (built / "index.d.ts").exists() and (built / "index.js").exists()


def test_node_test_runner_against_a_real_server(pal_server: PalServer, tenant_key: str, built: Path) -> None:
    del tenant_key, built  # the warm template exists; the SDK is compiled
    key = pal_server.tenant("e2e-typescript", max_vms=3)
    out = _run(
        ["node", "--test", "--test-reporter=spec", "test/"],
        env={"PAL_URL": pal_server.url, "PAL_API_KEY": key},
    )
    print(out)
    got = runner_summary(out)
    # Every test case in test/ ran and passed: a renamed or unloadable file runs 0 tests.
    assert got.get("fail") == 0 and got.get("cancelled") == 0, got
    assert got.get("pass", 0) >= count_test_cases(SDK / "test") > 0, got


def runner_summary(out: str) -> dict[str, int]:
    """The counts of `node --test`'s closing summary (spec reporter: "ℹ pass 12"; TAP: "# pass 12")."""
    lines = re.findall(r"^(?:ℹ|#) (tests|suites|pass|fail|cancelled|skipped|todo) (\d+)$", out, re.M)
    return {name: int(n) for name, n in lines}


def count_test_cases(test_dir: Path) -> int:
    """The ``test("...")`` / ``it("...")`` cases written in the SDK's test files."""
    cases = 0
    for f in sorted(test_dir.glob("*.*js")) + sorted(test_dir.glob("*.ts")):
        cases += len(re.findall(r"\b(?:test|it)\(\s*[\"'`]", f.read_text()))
    return cases
