"""Kept snapshots through the SDKs against the real API over loopback HTTP (the fake node):
the Python SDK (sync and async) and the TypeScript SDK under `node --test`
(sdk/typescript/test/snapshots.test.mjs); the Go SDK's requests are its own unit test
(sdk/go/client_test.go, run by test_go_sdk.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pal.sdk import AsyncClient, BadRequestError, Client, NotFoundError
from tests.apienv import ApiEnv, make_api, serve

TS = Path(__file__).resolve().parents[2] / "sdk" / "typescript"


def _guest_env(env: ApiEnv, vm_id: str) -> dict[str, str]:
    """The environment the VM's guest was given at its spawn (the fake node's request)."""
    [*_, req] = [r for r in env.manager.spawn_requests if r.vm_id == vm_id]
    return dict(req.env)


def test_the_python_sdk(tmp_path: Path) -> None:
    env = make_api(tmp_path, max_vms=4)
    with serve(env.app) as url, Client(url, env.key_a, timeout=10) as c:
        vm = c.runtime.schedule(metadata={"team": "py"})["vmId"]
        kept = c.runtime.keep_snapshot(vm, "py-golden")
        [plain] = c.runtime.start_from_snapshot("py-golden")["forks"]
        assert c.runtime.get(plain["vmId"])["metadata"] == {"team": "py"}
        [tagged] = c.runtime.start_from_snapshot(
            kept["snapshotId"], metadata={"run": "1"}, secrets={"A": "1"}
        )["forks"]
        assert c.runtime.get(tagged["vmId"])["metadata"] == {"run": "1"}
        assert _guest_env(env, tagged["vmId"]) == {"A": "1"}
        [forked] = c.runtime.fork(vm, metadata={"f": "1"}, secrets={"B": "2"})["forks"]
        assert c.runtime.get(forked["vmId"])["metadata"] == {"f": "1"}
        assert _guest_env(env, forked["vmId"]) == {"B": "2"}
        c.runtime.delete(forked["vmId"])
        assert [v["vmId"] for v in c.runtime.list({"run": "1"})] == [tagged["vmId"]]
        with pytest.raises(BadRequestError):
            c.runtime.start_from_snapshot("py-golden", metadata={"a b": "1"})
        for v in (vm, plain["vmId"], tagged["vmId"]):
            c.runtime.delete(v)

        async def async_calls() -> None:
            async with AsyncClient(url, env.key_a, timeout=10) as ac:
                [child] = (
                    await ac.runtime.start_from_snapshot("py-golden", metadata={}, secrets={"C": "3"})
                )["forks"]
                assert (await ac.runtime.get(child["vmId"]))["metadata"] == {}
                assert _guest_env(env, child["vmId"]) == {"C": "3"}
                [forked] = (await ac.runtime.fork(child["vmId"], metadata={"g": "1"}, secrets={"D": "4"}))[
                    "forks"
                ]
                assert (await ac.runtime.get(forked["vmId"]))["metadata"] == {"g": "1"}
                assert _guest_env(env, forked["vmId"]) == {"C": "3", "D": "4"}
                assert (await ac.runtime.delete_kept_snapshot("py-golden"))["snapshotId"] == kept[
                    "snapshotId"
                ]
                with pytest.raises(NotFoundError):
                    await ac.runtime.start_from_snapshot("py-golden")

        asyncio.run(async_calls())


def test_the_typescript_sdk(tmp_path: Path) -> None:
    node, npx = shutil.which("node"), shutil.which("npx")
    if not node or not npx or not (TS / "node_modules").is_dir():
        pytest.fail("node and the SDK's node_modules are missing: run scripts/install.sh --for-tests")
    build = subprocess.run([npx, "tsc", "-p", "tsconfig.json"], cwd=TS, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    env = make_api(tmp_path, max_vms=4)
    with serve(env.app) as url:
        run = subprocess.run(
            [node, "--test", "test/snapshots.test.mjs"],
            cwd=TS,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PAL_URL": url, "PAL_API_KEY": env.key_a},
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "# pass 1" in run.stdout and "# fail 0" in run.stdout, run.stdout
