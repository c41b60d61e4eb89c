"""The `pal` CLI as a user runs it: JSON out, readable errors, exit statuses, files as
bytes, tenants, images, doctor and help."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pal.cli.main import app
from pal.config import Settings
from pal.errors import Unavailable
from pal.store import Store
from tests.apienv import ApiEnv, make_api, serve
from tests.conftest import free_port

runner = CliRunner()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[ApiEnv, dict[str, str]]]:
    env = make_api(tmp_path, max_vms=5)
    with serve(env.app) as url:
        yield env, {"PAL_URL": url, "PAL_API_KEY": env.key_a}


def _ok(args: list[str], envs: dict[str, str], stdin: str | None = None) -> object:
    res = runner.invoke(app, args, env=envs, input=stdin)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_vm_lifecycle_commands(live: tuple[ApiEnv, dict[str, str]]) -> None:
    env, envs = live
    vm = _ok(["vm", "schedule", "--memory-mib", "512", "--idle-timeout", "60", "--secret", "A=1"], envs)
    assert isinstance(vm, dict) and vm["limits"]["memoryMib"] == 512 and vm["idleTimeoutSecs"] == 60
    vm_id = vm["vmId"]
    assert [v["vmId"] for v in _ok(["vm", "ls"], envs)] == [vm_id]  # type: ignore[union-attr]
    assert _ok(["vm", "pause", vm_id], envs)["state"] == "paused"  # type: ignore[index]
    res = runner.invoke(app, ["vm", "pause", vm_id], env=envs)
    assert res.exit_code == 1
    assert (
        res.stderr == f"pal: error: VM {vm_id} is paused: cannot pause (allowed when live-paused, running)"
        " (FAILED_PRECONDITION)\n"
    )
    res = runner.invoke(app, ["--json", "vm", "pause", vm_id], env=envs)
    assert res.exit_code == 1 and json.loads(res.stderr)["error"]["code"] == "FAILED_PRECONDITION"
    assert res.stderr.endswith("}\n")
    assert _ok(["vm", "resume", vm_id], envs)["state"] == "running"  # type: ignore[index]
    assert len(_ok(["vm", "fork", vm_id, "-n", "3"], envs)["forks"]) == 3  # type: ignore[index]
    tagged = _ok(["vm", "fork", vm_id, "--meta", "run=9", "--secret", "B=2"], envs)["forks"]  # type: ignore[index]
    assert _ok(["vm", "get", tagged[0]["vmId"]], envs)["metadata"] == {"run": "9"}  # type: ignore[index]
    assert dict(env.manager.spawn_requests[-1].env) == {"A": "1", "B": "2"}, "over the source's"
    res = runner.invoke(app, ["vm", "fork", vm_id, "--secret", "nope"], env=envs)
    assert res.exit_code != 0 and "--secret" in res.output
    assert "paused" in [e["toState"] for e in _ok(["vm", "events", vm_id], envs)]  # type: ignore[union-attr]
    assert _ok(["vm", "rm", vm_id], envs)["state"] == "terminated"  # type: ignore[index]


def test_vm_ls_hides_terminated_and_never_cuts_ids(live: tuple[ApiEnv, dict[str, str]]) -> None:
    env, envs = live
    env.manager.fail("spawn", Unavailable("no host limits"))  # a VM that failed to start
    assert runner.invoke(app, ["vm", "schedule", "-q"], env=envs).exit_code == 1
    quiet = runner.invoke(app, ["vm", "schedule", "-q"], env=envs)
    gone = quiet.stdout.strip()
    assert quiet.exit_code == 0 and gone.startswith("vm-") and len(gone) == 27
    keep = runner.invoke(app, ["vm", "schedule", "-q"], env=envs).stdout.strip()
    _ok(["vm", "rm", gone], envs)
    assert runner.invoke(app, ["vm", "ls", "-q"], env=envs).stdout.split() == [keep]
    every = runner.invoke(app, ["vm", "ls", "--all"], env=envs).stdout
    assert sorted(v["state"] for v in json.loads(every)) == ["failed", "running", "terminated"]
    assert [v["vmId"] for v in _ok(["vm", "ls"], envs)] == [keep]  # type: ignore[union-attr]
    table = runner.invoke(app, ["vm", "ls", "--table", "--all"], env=envs, terminal_width=40)
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["vmId", "state", "image"]
    assert {gone, keep} <= {line.split()[0] for line in lines[1:]}  # whole ids, one row each


def test_bad_flags_are_reported(live: tuple[ApiEnv, dict[str, str]]) -> None:
    _, envs = live
    res = runner.invoke(app, ["vm", "schedule", "--vcpus", "0"], env=envs)
    assert res.exit_code == 1 and "limits.vcpus" in res.stderr
    res = runner.invoke(app, ["vm", "get", "vm-nope"], env=envs)
    assert res.exit_code == 1 and res.stderr == "pal: error: VM vm-nope not found (NOT_FOUND)\n"
    res = runner.invoke(app, ["vm", "ls"], env={**envs, "PAL_API_KEY": "pal_bad"})
    assert res.exit_code == 1 and "UNAUTHENTICATED" in res.stderr
    res = runner.invoke(app, ["vm", "ls"], env={**envs, "PAL_API_KEY": None})  # type: ignore[dict-item]
    assert res.exit_code == 1 and "PAL_API_KEY" in res.stderr, "says where the CLI takes the key from"


@pytest.mark.parametrize("stream", [False, True])
def test_exec_exit_status_is_the_commands(live: tuple[ApiEnv, dict[str, str]], stream: bool) -> None:
    _, envs = live
    vm_id = _ok(["vm", "schedule"], envs)["vmId"]  # type: ignore[index]
    flags = ["--stream"] if stream else []
    res = runner.invoke(app, ["vm", "exec", vm_id, *flags, "--", "fail", "3"], env=envs)
    assert res.exit_code == 3
    assert res.stdout == "" and res.stderr == "warn\n"
    res = runner.invoke(app, ["vm", "exec", vm_id, *flags, "--", "echo", "-n", "ok"], env=envs)
    assert res.exit_code == 0 and res.stdout == "-n ok\n"
    res = runner.invoke(app, ["vm", "exec", vm_id, *flags, "--", "/nope"], env=envs)
    assert res.exit_code == 1 and res.stderr == "pal: error: /nope: not found (EXECUTABLE_NOT_FOUND)\n"
    res = runner.invoke(app, ["vm", "exec", vm_id, *flags, "--timeout", "2", "--", "sleepy"], env=envs)
    assert res.exit_code == 124 and res.stdout == "partial"
    assert res.stderr == "pal: the command timed out after 2 s and was killed (exit status 124)\n"


def test_exec_as_root(live: tuple[ApiEnv, dict[str, str]]) -> None:
    env, envs = live
    vm_id = _ok(["vm", "schedule"], envs)["vmId"]  # type: ignore[index]
    assert runner.invoke(app, ["vm", "exec", vm_id, "--user", "root", "--", "true"], env=envs).exit_code == 0
    assert runner.invoke(app, ["vm", "exec", vm_id, "--", "true"], env=envs).exit_code == 0
    assert [r.user for r in env.manager.exec_requests] == ["root", None]
    res = runner.invoke(app, ["vm", "exec", vm_id, "--user", "no such user!", "--", "true"], env=envs)
    assert res.exit_code == 1 and "user must be a user name" in res.stderr


def test_files_commands(live: tuple[ApiEnv, dict[str, str]], tmp_path: Path) -> None:
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


def test_files_are_copied_byte_for_byte(live: tuple[ApiEnv, dict[str, str]], tmp_path: Path) -> None:
    env, envs = live
    vm_id = _ok(["vm", "schedule"], envs)["vmId"]  # type: ignore[index]
    blob = bytes(range(256))
    (tmp_path / "blob.bin").write_bytes(blob)
    assert _ok(["files", "put", vm_id, "blob.bin", str(tmp_path / "blob.bin")], envs)["bytesWritten"] == 256  # type: ignore[index]
    cat = runner.invoke(app, ["files", "cat", vm_id, "blob.bin"], env=envs)
    assert cat.exit_code == 0 and cat.stdout_bytes == blob  # 256 bytes, not 512
    got = runner.invoke(app, ["files", "get", vm_id, "blob.bin", str(tmp_path / "copy.bin")], env=envs)
    assert got.exit_code == 0 and (tmp_path / "copy.bin").read_bytes() == blob
    stdout = runner.invoke(app, ["files", "get", vm_id, "blob.bin"], env=envs)
    assert stdout.stdout_bytes == blob
    env.manager.alive[vm_id].files["big.bin"] = b"z" * (1024 * 1024 + 1)
    cut = runner.invoke(app, ["files", "get", vm_id, "big.bin", str(tmp_path / "big.bin")], env=envs)
    assert cut.exit_code == 1 and "larger than 1 MiB" in cut.stderr
    assert (tmp_path / "big.bin").stat().st_size == 1024 * 1024
    assert _ok(["files", "rm", vm_id, "blob.bin"], envs) == {"path": "blob.bin", "deleted": True}
    res = runner.invoke(app, ["files", "rm", vm_id, "blob.bin"], env=envs)
    assert res.exit_code == 1 and "FILE_NOT_FOUND" in res.stderr
    res = runner.invoke(app, ["files", "put", vm_id, "x", str(tmp_path / "missing")], env=envs)
    assert res.exit_code == 1 and "cannot read" in res.stderr


def test_tenants_create_and_ls(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    res = runner.invoke(app, ["tenants", "create", "acme", "--data-dir", data])
    assert res.exit_code == 1 and "no Pal store in" in res.stderr, "not a data dir a server used"
    assert not (tmp_path / "data").exists(), "and nothing is created there"
    Store.open(Settings(data_dir=Path(data))).close()  # as the first `pal up` does
    res = runner.invoke(app, ["tenants", "create", "acme", "--max-vms", "5", "--data-dir", data])
    assert res.exit_code == 0, res.output
    created = json.loads(res.stdout)
    assert created["name"] == "acme" and created["maxVms"] == 5
    quiet = runner.invoke(app, ["tenants", "create", "other", "-q", "--data-dir", data])
    assert quiet.exit_code == 0 and quiet.stdout.startswith("pal_") and quiet.stdout.count("\n") == 1
    store = Store.open(Settings(data_dir=Path(data)))
    try:
        tenant = store.tenant_by_api_key(created["apiKey"])  # the printed key works
        assert tenant is not None and tenant.id == created["id"]
    finally:
        store.close()
    dup = runner.invoke(app, ["tenants", "create", "acme", "--max-vms", "1", "--data-dir", data])
    assert dup.exit_code == 1 and "already exists" in dup.stderr
    # --exist-ok: a script that made its tenant runs again (the README's tour does)
    again = runner.invoke(
        app, ["tenants", "create", "acme", "--max-vms", "2", "-q", "--exist-ok", "--data-dir", data]
    )
    assert again.exit_code == 0, again.output
    store = Store.open(Settings(data_dir=Path(data)))
    try:
        renewed = store.tenant_by_api_key(again.stdout.strip())
        assert renewed is not None and renewed.id == created["id"] and renewed.max_vms == 2
        assert store.tenant_by_api_key(created["apiKey"]) is None, "the old key is refused"
    finally:
        store.close()
    listed = json.loads(runner.invoke(app, ["tenants", "ls", "--data-dir", data]).stdout)
    assert [t["name"] for t in listed] == ["acme", "other"] and "apiKey" not in listed[0]


def test_image_build_reports_progress(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pal.images
    from pal.images import ImagePaths

    seen: list[tuple[str, float]] = []

    def fake_build(
        settings: Settings, name: str, progress: object = None, force: bool = False, tenants: object = None
    ) -> ImagePaths:
        assert settings.data_dir == tmp_path and force is True and tenants is None
        for step, frac in [("rootfs", 0.5), ("done", 1.0)]:
            seen.append((step, frac))
            progress(step, frac)  # type: ignore[operator]
        d = tmp_path / "images" / name
        return ImagePaths(name=name, dir=d, vmlinux=d / "vmlinux", initrd=d / "initrd.img", rootfs=d / "r")

    import pal.server

    prepared: list[Path] = []
    monkeypatch.setattr(pal.images, "build_image", fake_build)

    # The real ones would loop-mount an XFS image on this non-reflink tmp dir.
    def ensure(settings: Settings, log: Callable[[str], object]) -> str:
        prepared.append(settings.data_dir)
        log(f"data dir {settings.data_dir}: file system supports reflink")
        return "native"

    import pal.vmm.datadir

    monkeypatch.setattr(pal.vmm.datadir, "ensure_reflink_datadir", ensure)
    monkeypatch.setattr(pal.server, "prepare_data_dir", lambda s: prepared.append(s.data_dir) or "native")
    res = runner.invoke(app, ["image", "build", "mini", "--data-dir", str(tmp_path), "--force"])
    assert res.exit_code == 0, res.output
    assert prepared == [tmp_path, tmp_path], "the data dir is made reflink-capable before building"
    assert f"data dir {tmp_path}: file system supports reflink" in res.stderr, "and says what it did"
    assert seen == [("rootfs", 0.5), ("done", 1.0)]
    assert '"name": "mini"' in res.stdout
    # not a terminal (a log): plain lines, one per step (pal/ops/progress.py)
    assert "image mini: rootfs (50%)" in res.stderr and "image mini: done in " in res.stderr


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


def test_a_server_on_all_interfaces_needs_the_url_replicas_reach_it_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bound to 0.0.0.0 a replica cannot know its own address: it would advertise
    127.0.0.1, and every follower would forward to itself. It refuses to start instead."""
    import pal.server

    calls: list[tuple[str, int, str | None]] = []
    monkeypatch.setattr(pal.server, "run_control_plane", lambda s, h, p, a: calls.append((h, p, a)))
    db = ["--database", "postgresql://pal:x@db.invalid/pal"]  # never reached
    for host in ("0.0.0.0", "::"):
        res = runner.invoke(app, ["server", "--host", host, *db])
        assert res.exit_code == 2 and "--advertise-url" in res.output, res.output
    res = runner.invoke(app, ["server", "--host", "0.0.0.0", "--advertise-url", "http://0.0.0.0:8080", *db])
    assert res.exit_code == 2 and "names no machine" in res.output, res.output
    res = runner.invoke(app, ["server", "--host", "0.0.0.0", "--advertise-url", "10.0.0.11:8080", *db])
    assert res.exit_code == 2 and "http(s) URL" in res.output, res.output
    assert calls == []
    ok = runner.invoke(app, ["server", "--host", "0.0.0.0", "--advertise-url", "http://10.0.0.11:8080/", *db])
    assert ok.exit_code == 0, ok.output
    ok = runner.invoke(app, ["server", "--host", "10.0.0.11", "--port", "8090", *db])
    assert ok.exit_code == 0, ok.output
    assert calls == [("0.0.0.0", 8080, "http://10.0.0.11:8080"), ("10.0.0.11", 8090, "http://10.0.0.11:8090")]


def test_egress_flags_and_live_change(live: tuple[ApiEnv, dict[str, str]]) -> None:
    _, envs = live
    vm = _ok(
        ["vm", "schedule", "--allow", "pypi.org", "--allow", "*.pythonhosted.org:443", "--egress-mbps", "50"],
        envs,
    )
    assert vm["egress"] == {"allow": ["pypi.org", "*.pythonhosted.org:443"]}  # type: ignore[index]
    assert vm["limits"]["egressMbps"] == 50  # type: ignore[index]
    vm_id = vm["vmId"]  # type: ignore[index]
    assert _ok(["vm", "schedule", "--egress", "none"], envs)["egress"] == "none"  # type: ignore[index]
    assert _ok(["vm", "schedule", "--deny", "10.0.0.0/8"], envs)["egress"] == {"deny": ["10.0.0.0/8"]}  # type: ignore[index]
    assert _ok(["vm", "egress", vm_id, "--open"], envs)["egress"] == "open"  # type: ignore[index]
    assert _ok(["vm", "egress", vm_id, "--deny", "evil.test"], envs)["egress"] == {"deny": ["evil.test"]}  # type: ignore[index]
    got = _ok(["vm", "get", vm_id], envs)
    assert got["egress"] == {"deny": ["evil.test"]} and "network" in got  # type: ignore[index,operator]
    for bad in (
        ["vm", "egress", vm_id],
        ["vm", "egress", vm_id, "--open", "--none"],
        ["vm", "schedule", "--egress", "open", "--allow", "x.test"],
        ["vm", "schedule", "--egress", "closed"],
    ):
        assert runner.invoke(app, bad, env=envs).exit_code != 0, bad
    res = runner.invoke(app, ["vm", "egress", vm_id, "--allow", "not a host"], env=envs)
    assert res.exit_code == 1 and "not a host" in res.stderr


def test_doctor_fails_when_the_server_is_down(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    res = runner.invoke(app, ["doctor", "--data-dir", str(tmp_path), "--url", closed])
    assert res.exit_code == 1, res.output
    rows = {line.split()[0]: line for line in res.stdout.splitlines()[1:]}
    assert "FAIL" in rows["server"] and "pal up" in rows["server"]
    assert "FAIL" in rows["store"] and "does not exist yet" in rows["store"]


def test_doctor_checks_the_store_and_the_manager_of_a_running_server(
    live: tuple[ApiEnv, dict[str, str]],
) -> None:
    env, envs = live
    res = runner.invoke(app, ["doctor", "--json", "--data-dir", str(env.sched.settings.data_dir)], env=envs)
    checks = {c["check"]: c for c in json.loads(res.stdout)}
    assert checks["server"]["ok"] is True and checks["manager"]["ok"] is True
    from pal.store import migrate

    assert checks["store"]["ok"] is True
    assert f"schema {migrate.head()}, 2 tenants" in checks["store"]["detail"]
    assert checks["image"]["ok"] is False  # no image was built in this data dir
    assert res.exit_code == 1


def test_doctor_shows_the_managers_details_with_the_operators_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAL_ADMIN_TOKEN", "op-secret")
    env = make_api(tmp_path, health=lambda: {"ok": True, "accel": "tcg", "vms": 3})
    env.sched.settings.admin_token = "op-secret"  # the server's; doctor reads the same variable
    with serve(env.app) as url:
        args = ["doctor", "--json", "--data-dir", str(env.sched.settings.data_dir), "--url", url]
        shown = {c["check"]: c for c in json.loads(runner.invoke(app, args).stdout)}
        assert shown["manager"] == {
            "check": "manager",
            "ok": True,
            "detail": "answers (accel tcg, 3 VMs live)",
        }
        blind = runner.invoke(app, args, env={"PAL_ADMIN_TOKEN": "wrong"}).stdout
        hidden = {c["check"]: c for c in json.loads(blind)}
        assert hidden["manager"]["detail"] == (
            "answers (its details need the operator token: run as root on the server's host, "
            "or set PAL_ADMIN_TOKEN)"
        )


def test_doctor_says_what_the_running_server_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server started with PAL_CGROUPS=off starts VMs, whatever this shell's environment
    would: doctor shows the server's settings and host rows, and fails only on what stops
    the server's VMs."""
    monkeypatch.setenv("PAL_ADMIN_TOKEN", "op-secret")
    rows = [{"check": "cgroups", "ok": None, "detail": "OFF: PAL_CGROUPS=off; effect: ..."}]
    env = make_api(tmp_path, health=lambda: {"ok": True, "accel": "tcg", "vms": 0}, host_checks=lambda: rows)
    env.sched.settings.admin_token = "op-secret"
    env.sched.settings.cgroups = False
    with serve(env.app) as url:
        args = ["doctor", "--json", "--url", url]
        res = runner.invoke(app, args)
        shown = {c["check"]: c for c in json.loads(res.stdout)}
        assert shown["cgroups"] == rows[0], "the server's row, not this shell's probe"
        assert "PAL_CGROUPS=false (this shell: true)" in shown["settings"]["detail"]
        assert "PAL_ADMIN_TOKEN" not in shown["settings"]["detail"], "secrets are never shown"
        assert shown["store"]["ok"] is True, "the store of the server's data dir"
        rows[0] = {"check": "cgroups", "ok": False, "detail": "MISSING: no pids controller"}
        assert runner.invoke(app, args).exit_code == 1, "VMs cannot start: doctor fails"


def _commands(group: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, cmd in group.commands.items():
        out.append((f"{prefix}{name}", cmd))
        if hasattr(cmd, "commands"):  # a group
            out.extend(_commands(cmd, f"{prefix}{name} "))
    return out


def test_every_command_has_help() -> None:
    import typer.main

    root = typer.main.get_command(app)
    commands = _commands(root)
    assert len(commands) > 20
    for name, cmd in commands:
        assert (cmd.help or "").strip(), f"`pal {name}` has no help"  # type: ignore[attr-defined]
        # `pal --help` lists a command by its first paragraph, line breaks kept: one line
        first = (cmd.help or "").strip().split("\n\n")[0]  # type: ignore[attr-defined]
        assert "\n" not in first, f"`pal {name}`: the help's first paragraph is not one line"
        for param in cmd.params:  # type: ignore[attr-defined]
            if param.name != "help" and hasattr(param, "help"):
                assert (param.help or "").strip(), f"`pal {name}`: {param.name} has no help"


def test_kept_snapshot_commands(live: tuple[ApiEnv, dict[str, str]]) -> None:
    env, envs = live
    vm_id = runner.invoke(app, ["vm", "schedule", "--meta", "team=a", "-q"], env=envs).stdout.strip()
    kept = _ok(["vm", "snapshot", vm_id, "--name", "golden"], envs)
    assert isinstance(kept, dict) and kept["name"] == "golden" and kept["sourceVmId"] == vm_id
    plain = runner.invoke(app, ["vm", "snapshot", vm_id, "-q"], env=envs).stdout.strip()
    assert plain.startswith("snap-") and plain != kept["snapshotId"]
    listed = _ok(["vm", "snapshots", "--vm", vm_id], envs)
    assert [k["snapshotId"] for k in listed] == [kept["snapshotId"], plain]  # type: ignore[union-attr]
    assert runner.invoke(app, ["vm", "snapshots", "--name", "golden", "-q"], env=envs).stdout.split() == [
        kept["snapshotId"]
    ]
    table = runner.invoke(app, ["vm", "snapshots", "--table"], env=envs, terminal_width=40).stdout
    assert table.splitlines()[0].split() == ["snapshotId", "name", "sourceVmId", "createdAt"]
    _ok(["vm", "rm", vm_id], envs)

    started = _ok(["vm", "start-snapshot", "golden", "--meta", "run=1", "--secret", "S=2"], envs)
    [child] = started["forks"]  # type: ignore[index]
    assert dict(env.manager.spawn_requests[-1].env)["S"] == "2"
    assert child["state"] == "running" and started["snapshotId"] == kept["snapshotId"]  # type: ignore[index]
    assert _ok(["vm", "get", child["vmId"]], envs)["metadata"] == {"run": "1"}  # type: ignore[index]
    quiet = runner.invoke(app, ["vm", "start-snapshot", plain, "-n", "2", "-q"], env=envs)
    ids = quiet.stdout.split()
    assert quiet.exit_code == 0 and len(ids) == 2 and all(i.startswith("vm-") for i in ids)
    assert _ok(["vm", "get", ids[0]], envs)["metadata"] == {"team": "a"}  # type: ignore[index]
    res = runner.invoke(app, ["vm", "start-snapshot", "golden", "--meta", "nope"], env=envs)
    assert res.exit_code != 0 and "--meta" in res.output

    assert _ok(["vm", "snapshot-rm", "golden"], envs) == kept
    res = runner.invoke(app, ["vm", "start-snapshot", "golden"], env=envs)
    assert res.exit_code == 1 and res.stderr == "pal: error: snapshot golden not found (NOT_FOUND)\n"
    res = runner.invoke(app, ["vm", "snapshot", "vm-nope"], env=envs)
    assert res.exit_code == 1 and "NOT_FOUND" in res.stderr
