"""A volume's files through the three SDKs against the real API over loopback HTTP (the
node's real volume code under tests/fakes.py; a volume needs no VM): the Python SDK (sync
and async), the TypeScript SDK under `node --test` (sdk/typescript/test/volumes.test.mjs),
and the Go SDK's own test of its requests (sdk/go/volumes_test.go)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pal.sdk import AsyncClient, BadRequestError, Client, NotFoundError
from tests.apienv import make_api, serve

REPO = Path(__file__).resolve().parents[2]
TS = REPO / "sdk" / "typescript"


def test_the_python_sdk(tmp_path: Path) -> None:
    env = make_api(tmp_path)
    with serve(env.app) as url, Client(url, env.key_a, timeout=10) as c:
        vol = c.volumes.create("py", 8)
        assert c.volumes.write_file("py", "d/a.txt", "héllo") == {"path": "d/a.txt", "bytesWritten": 6}
        c.volumes.write_file(vol["volumeId"], "bin", b"\x00\xff")
        text = c.volumes.read_file("py", "d/a.txt")
        assert text == "héllo" and text.truncated is False
        assert c.volumes.read_file_bytes("py", "bin") == b"\x00\xff"
        with pytest.raises(UnicodeDecodeError):
            c.volumes.read_file("py", "bin")
        listed = c.volumes.list_files("py", depth=2)
        assert [(e["path"], e["type"]) for e in listed["entries"]] == [
            ("bin", "file"),
            ("d", "dir"),
            ("d/a.txt", "file"),
        ]
        assert [e["name"] for e in c.volumes.list_files("py", "d")["entries"]] == ["a.txt"]
        assert c.volumes.stat("py", "d/a.txt")["size"] == 6
        assert c.volumes.exists("py", "d/a.txt") and not c.volumes.exists("py", "nope")
        with pytest.raises(NotFoundError):
            c.volumes.exists("no-such-volume", "x")  # the volume is missing, not the file
        assert c.volumes.make_dir("py", "p/q", parents=True) == {"path": "p/q", "created": True}
        with pytest.raises(BadRequestError):
            c.volumes.delete_file("py", "p")
        assert c.volumes.delete_file("py", "p", recursive=True)["deleted"] is True
        with pytest.raises(BadRequestError) as esc:
            c.volumes.read_file("py", "../x")
        assert esc.value.code == "PATH_ESCAPE"
        with Client(url, env.key_b, timeout=10) as bob, pytest.raises(NotFoundError):
            bob.volumes.read_file("py", "d/a.txt")

        async def async_calls() -> None:
            async with AsyncClient(url, env.key_a, timeout=10) as ac:
                assert (await ac.volumes.write_file("py", "async.txt", "x"))["bytesWritten"] == 1
                assert await ac.volumes.read_file("py", "async.txt") == "x"
                assert await ac.volumes.read_file_bytes("py", "async.txt") == b"x"
                assert (await ac.volumes.stat("py", "async.txt"))["type"] == "file"
                assert await ac.volumes.exists("py", "async.txt")
                assert not await ac.volumes.exists("py", "gone")
                names = [e["name"] for e in (await ac.volumes.list_files("py"))["entries"]]
                assert names == ["async.txt", "bin", "d"]
                assert (await ac.volumes.make_dir("py", "m"))["created"] is True
                assert (await ac.volumes.delete_file("py", "m", recursive=True))["deleted"] is True
                assert (await ac.volumes.delete_file("py", "async.txt"))["deleted"] is True

        asyncio.run(async_calls())


def test_the_typescript_sdk(tmp_path: Path) -> None:
    node, npx = shutil.which("node"), shutil.which("npx")
    if not node or not npx or not (TS / "node_modules").is_dir():
        pytest.fail("node and the SDK's node_modules are missing: run scripts/install.sh --for-tests")
    build = subprocess.run([npx, "tsc", "-p", "tsconfig.json"], cwd=TS, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    env = make_api(tmp_path)
    with serve(env.app) as url:
        run = subprocess.run(
            [node, "--test", "test/volumes.test.mjs"],
            cwd=TS,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PAL_URL": url, "PAL_API_KEY": env.key_a, "PAL_OTHER_KEY": env.key_b},
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "# pass 1" in run.stdout and "# fail 0" in run.stdout, run.stdout


def test_the_go_sdk() -> None:
    go = shutil.which("go")
    if not go:
        pytest.fail("go is missing: run scripts/install.sh --for-tests")
    run = subprocess.run(
        [go, "test", "-run", "TestVolume", "./..."],
        cwd=REPO / "sdk" / "go",
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off"},
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_cli(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from pal.cli.main import app

    env = make_api(tmp_path / "api")
    runner = CliRunner()
    with serve(env.app) as url:
        envs = {"PAL_URL": url, "PAL_API_KEY": env.key_a}

        def run(*args: str, input: bytes | None = None) -> tuple[int, str, str]:
            res = runner.invoke(app, list(args), env=envs, input=input)
            return res.exit_code, res.stdout, res.stderr

        # `pal volume` is `pal volumes` (issue 34 names it so)
        assert run("volume", "create", "cli", "--size-mib", "8", "-q")[0] == 0
        local = tmp_path / "seed.bin"
        local.write_bytes(b"\x00seed\xff")
        code, out, _ = run("volumes", "put", "cli", "in/seed.bin", str(local))
        assert code == 0 and json.loads(out) == {"path": "in/seed.bin", "bytesWritten": 6}
        assert run("volume", "put", "cli", "note.txt", "-", input=b"from stdin")[0] == 0
        assert run("volumes", "cat", "cli", "note.txt")[1] == "from stdin"
        copy = tmp_path / "copy.bin"
        assert run("volumes", "get", "cli", "in/seed.bin", str(copy))[0] == 0
        assert copy.read_bytes() == b"\x00seed\xff"
        code, out, _ = run("volumes", "get", "cli")  # without PATH: the volume itself
        assert code == 0 and json.loads(out)["name"] == "cli"
        code, out, _ = run("volumes", "ls-files", "cli", "--depth", "2", "--table")
        assert code == 0 and "in/seed.bin" in out and "note.txt" in out
        listed = json.loads(run("volumes", "ls-files", "cli")[1])
        assert [e["name"] for e in listed["entries"]] == ["in", "note.txt"]
        assert json.loads(run("volumes", "stat", "cli", "note.txt")[1])["size"] == 10
        code, _, err = run("volumes", "stat", "cli", "nope")
        assert code == 1 and "FILE_NOT_FOUND" in err
        assert json.loads(run("volumes", "mkdir", "cli", "a/b", "-p")[1]) == {"path": "a/b", "created": True}
        code, _, err = run("volumes", "rm-file", "cli", "a")
        assert code == 1 and "directory" in err
        assert json.loads(run("volumes", "rm-file", "cli", "a", "-r")[1])["deleted"] is True
        code, _, err = run("volumes", "cat", "cli", "../etc/passwd")
        assert code == 1 and "PATH_ESCAPE" in err
        assert json.loads(run("volume", "rm", "cli")[1])["state"] == "deleted"
