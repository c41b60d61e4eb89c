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
    other = pal_server.tenant("e2e-typescript-other", max_vms=1)  # volumes.test.mjs: another tenant's 404s
    out = _run(
        ["node", "--test", "--test-reporter=spec", "test/"],
        env={"PAL_URL": pal_server.url, "PAL_API_KEY": key, "PAL_OTHER_KEY": other},
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


def _npm(args: list[str], cwd: Path) -> str:
    res = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(args)} in {cwd} ({res.returncode}):\n{res.stdout}{res.stderr}"
    return res.stdout


def _project(where: Path, dependency: str) -> Path:
    """A TypeScript project of a user's, outside the SDK's directory, that depends on the
    SDK as the README says (``npm install <tarball>`` or ``npm install <sdk dir>``), with
    the SDK's example as its source."""
    where.mkdir()
    (where / "package.json").write_text(json.dumps({"name": "my-agent", "private": True, "type": "module"}))
    # and Node's types, as the examples' tsconfig asks (`npm install -D @types/node`), the
    # SDK's pinned copy: no registry needed
    node_types = str(SDK / "node_modules" / "@types" / "node")
    _npm(["npm", "install", "--no-audit", "--no-fund", dependency, node_types], where)
    for name in ("quickstart.ts", "tsconfig.json"):
        shutil.copy(SDK / "examples" / name, where / name)
    # tsc of the SDK's pinned version (the project would `npm install -D typescript`)
    _npm(["node", str(SDK / "node_modules" / "typescript" / "bin" / "tsc"), "-p", "tsconfig.json"], where)
    return where


def test_a_project_installs_the_packed_sdk_compiles_and_runs_the_example(
    pal_server: PalServer, tenant_key: str, built: Path, tmp_path: Path
) -> None:
    """The README's path for another project: `npm pack` (its `prepare` builds dist), then
    `npm install` of the tarball; the `.ts` example compiles with tsc against the installed
    package's types and runs against a real server. Also the `file:` dependency path."""
    del tenant_key, built
    packed = tmp_path / "packed"
    packed.mkdir()
    out = _npm(["npm", "pack", "--pack-destination", str(packed)], SDK)
    tarball = packed / out.strip().splitlines()[-1]
    assert tarball.name == f"pal-sandbox-sdk-{json.loads((SDK / 'package.json').read_text())['version']}.tgz"
    listing = subprocess.run(["tar", "tzf", str(tarball)], capture_output=True, text=True, check=True).stdout
    assert {"package/dist/index.js", "package/dist/index.d.ts", "package/package.json"} <= set(
        listing.split()
    ), listing

    app = _project(tmp_path / "my-agent", str(tarball))
    installed = app / "node_modules" / "@pal-sandbox" / "sdk"
    assert not installed.is_symlink() and (installed / "dist" / "index.d.ts").exists()
    key = pal_server.tenant("e2e-typescript-project", max_vms=1)
    res = subprocess.run(
        ["node", "dist/quickstart.js"],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PAL_URL": pal_server.url, "PAL_API_KEY": key},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "exit 0: hello from Linux", lines
    assert lines[1].startswith("paused, snapshot ") and "none" not in lines[1], lines
    assert lines[2] == "exec while paused: 409 FAILED_PRECONDITION", lines
    assert lines[3] == "after resume: kept across a pause" and lines[-1] == "stream exit 0", lines
    # the stream's stdout, in however many chunks the guest wrote it (one event per chunk)
    streamed = [x.removeprefix("stdout: ") for x in lines[4:-1]]
    assert lines[4].startswith("stdout: ") and streamed == ["a", "b"], lines

    # `npm install /path/to/pal/sdk/typescript` (a file: dependency, built by `npm ci` there)
    linked = _project(tmp_path / "linked", str(SDK))
    assert json.loads((linked / "package.json").read_text())["dependencies"]["@pal-sandbox/sdk"].startswith(
        "file:"
    )
    assert (linked / "dist" / "quickstart.js").exists()
