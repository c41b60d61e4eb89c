"""The `pal` CLI as a user runs it: JSON out, exit statuses, stdin, tenants."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pal.cli.main import app
from pal.config import Settings
from pal.store import Store
from tests.unit.test_api_helpers import Env, make_env, serve

runner = CliRunner()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Env, dict[str, str]]]:
    env = make_env(tmp_path)
    with serve(env.app) as url:
        yield env, {"PAL_URL": url, "PAL_API_KEY": env.key_a}


def _ok(args: list[str], envs: dict[str, str], stdin: str | None = None) -> object:
    res = runner.invoke(app, args, env=envs, input=stdin)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_vm_lifecycle_commands(live: tuple[Env, dict[str, str]]) -> None:
    _, envs = live
    vm = _ok(["vm", "schedule", "--memory-mib", "512", "--idle-timeout", "60", "--secret", "A=1"], envs)
    assert isinstance(vm, dict) and vm["limits"]["memoryMib"] == 512 and vm["idleTimeoutSecs"] == 60
    vm_id = vm["vmId"]
    assert [v["vmId"] for v in _ok(["vm", "ls"], envs)] == [vm_id]  # type: ignore[union-attr]
    table = runner.invoke(app, ["vm", "ls", "--table"], env=envs)
    assert table.exit_code == 0 and vm_id[:8] in table.stdout
    assert _ok(["vm", "pause", vm_id], envs)["state"] == "paused"  # type: ignore[index]
    res = runner.invoke(app, ["vm", "pause", vm_id], env=envs)
    assert res.exit_code == 1 and json.loads(res.stderr)["error"]["code"] == "FAILED_PRECONDITION"
    assert _ok(["vm", "resume", vm_id], envs)["state"] == "running"  # type: ignore[index]
    assert len(_ok(["vm", "fork", vm_id, "-n", "3"], envs)["forks"]) == 3  # type: ignore[index]
    assert "auto_resume" in [e["kind"] for e in _ok(["vm", "events", vm_id], envs)]  # type: ignore[union-attr]
    assert _ok(["vm", "rm", vm_id], envs)["state"] == "terminated"  # type: ignore[index]


def test_bad_flags_are_reported(live: tuple[Env, dict[str, str]]) -> None:
    _, envs = live
    res = runner.invoke(app, ["vm", "schedule", "--vcpus", "0"], env=envs)
    assert res.exit_code == 1 and "limits.vcpus" in res.stderr
    res = runner.invoke(app, ["vm", "get", "vm-nope"], env=envs)
    assert res.exit_code == 1 and json.loads(res.stderr)["error"]["code"] == "NOT_FOUND"
    res = runner.invoke(app, ["vm", "ls"], env={**envs, "PAL_API_KEY": "pal_bad"})
    assert res.exit_code == 1 and "UNAUTHENTICATED" in res.stderr


@pytest.mark.parametrize("stream", [False, True])
def test_exec_exit_status_is_the_commands(live: tuple[Env, dict[str, str]], stream: bool) -> None:
    _, envs = live
    vm_id = _ok(["vm", "schedule"], envs)["vmId"]  # type: ignore[index]
    flags = ["--stream"] if stream else []
    res = runner.invoke(app, ["vm", "exec", vm_id, *flags, "--", "echo", "x", "fail"], env=envs)
    assert res.exit_code == 3
    assert res.stdout == "x fail\n" and res.stderr == "warn\n"
    res = runner.invoke(app, ["vm", "exec", vm_id, *flags, "--", "echo", "-n", "ok"], env=envs)
    assert res.exit_code == 0 and res.stdout == "-n ok\n"
    res = runner.invoke(app, ["vm", "exec", vm_id, *flags, "--", "/nope"], env=envs)
    assert res.exit_code == 1 and "EXECUTABLE_NOT_FOUND" in res.stderr


def test_files_commands(live: tuple[Env, dict[str, str]], tmp_path: Path) -> None:
    _, envs = live
    vm_id = _ok(["vm", "schedule"], envs)["vmId"]  # type: ignore[index]
    assert _ok(["files", "put", vm_id, "in.txt"], envs, stdin="from stdin")["bytesWritten"] == 10  # type: ignore[index]
    local = tmp_path / "local.py"
    local.write_text("print(1)\n")
    assert _ok(["files", "put", vm_id, "job.py", str(local)], envs)["bytesWritten"] == 9  # type: ignore[index]
    res = runner.invoke(app, ["files", "cat", vm_id, "job.py"], env=envs)
    assert res.exit_code == 0 and res.stdout == "print(1)\n"
    names = [e["name"] for e in _ok(["files", "ls", vm_id], envs)["entries"]]  # type: ignore[index]
    assert sorted(names) == ["in.txt", "job.py"]
    res = runner.invoke(app, ["files", "cat", vm_id, "/etc/passwd"], env=envs)
    assert res.exit_code == 1 and "PATH_ESCAPE" in res.stderr


def test_tenants_create_and_ls(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    res = runner.invoke(app, ["tenants", "create", "acme", "--max-vms", "5", "--data-dir", data])
    assert res.exit_code == 0, res.output
    created = json.loads(res.stdout)
    assert created["name"] == "acme" and created["maxVms"] == 5
    store = Store.open(Settings(data_dir=Path(data)))
    try:
        tenant = store.tenant_by_api_key(created["apiKey"])  # the printed key works
        assert tenant is not None and tenant.id == created["id"]
    finally:
        store.close()
    dup = runner.invoke(app, ["tenants", "create", "acme", "--max-vms", "1", "--data-dir", data])
    assert dup.exit_code == 1 and "already exists" in dup.stderr
    listed = json.loads(runner.invoke(app, ["tenants", "ls", "--data-dir", data]).stdout)
    assert [t["name"] for t in listed] == ["acme"] and "apiKey" not in listed[0]


def test_image_build_reports_progress(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pal.images
    from pal.images import ImagePaths

    seen: list[tuple[str, float]] = []

    def fake_build(settings: Settings, name: str, progress: object = None, force: bool = False) -> ImagePaths:
        assert settings.data_dir == tmp_path and force is True
        for step, frac in [("rootfs", 0.5), ("done", 1.0)]:
            seen.append((step, frac))
            progress(step, frac)  # type: ignore[operator]
        d = tmp_path / "images" / name
        return ImagePaths(name=name, dir=d, vmlinux=d / "vmlinux", initrd=d / "initrd.img", rootfs=d / "r")

    import pal.server

    prepared: list[Path] = []
    monkeypatch.setattr(pal.images, "build_image", fake_build)
    # The real one would loop-mount an XFS image on this non-reflink tmp dir.
    monkeypatch.setattr(pal.server, "prepare_data_dir", lambda s: prepared.append(s.data_dir) or "native")
    res = runner.invoke(app, ["image", "build", "mini", "--data-dir", str(tmp_path), "--force"])
    assert res.exit_code == 0, res.output
    assert prepared == [tmp_path], "the data dir is made reflink-capable before building"
    assert seen == [("rootfs", 0.5), ("done", 1.0)]
    assert '"name": "mini"' in res.stdout


def test_up_passes_flags_to_the_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pal.server

    calls: list[tuple[Settings, str, int]] = []
    monkeypatch.setattr(pal.server, "run", lambda s, h, p: calls.append((s, h, p)))
    res = runner.invoke(
        app, ["up", "--port", "9999", "--host", "0.0.0.0", "--accel", "tcg", "--data-dir", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    ((settings, host, port),) = calls
    assert (settings.data_dir, settings.accel, host, port) == (tmp_path, "tcg", "0.0.0.0", 9999)
    bad = runner.invoke(app, ["up", "--accel", "xen", "--data-dir", str(tmp_path)])
    assert bad.exit_code != 0 and len(calls) == 1
