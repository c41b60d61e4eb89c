"""The `pal` CLI as a user drives it: a shell with PAL_URL and PAL_API_KEY set, a real
`pal up` behind it, real microVMs. Every command runs as its own process, exactly as typed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, PalServer, free_port, pal_cli

pytestmark = pytest.mark.vm

TENANT = "e2e-cli"


@pytest.fixture(scope="module")
def user_env(pal_server: PalServer, tenant_key: str) -> dict[str, str]:
    """A user's shell: the two env vars, for a tenant of its own (so `vm ls` is exact).
    ``tenant_key`` is requested only so the warm template exists before the first schedule."""
    del tenant_key
    return {"PAL_URL": pal_server.url, "PAL_API_KEY": pal_server.tenant(TENANT, max_vms=6)}


def pal(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `pal --json ARGS` (errors as JSON, as a script wants them) whatever its exit status."""
    return subprocess.run(
        [sys.executable, "-m", "pal.cli.main", "--json", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=300,
    )


def pal_json(env: dict[str, str], *args: str, stdin: str | None = None) -> Any:
    """Run `pal ARGS`, require exit status 0, and return its JSON output."""
    res = pal(env, *args, stdin=stdin)
    assert res.returncode == 0, f"pal {' '.join(args)} -> {res.returncode}\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout)


def error_of(res: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The JSON error a failed command prints on stderr."""
    return dict(json.loads(res.stderr.strip().splitlines()[-1])["error"])


@pytest.fixture
def vms(user_env: dict[str, str]) -> Iterator[list[str]]:
    """VM ids a test made; all removed afterwards, even when the test fails."""
    made: list[str] = []
    try:
        yield made
    finally:
        for vm_id in made:
            pal(user_env, "vm", "rm", vm_id)


def schedule(env: dict[str, str], vms: list[str], *flags: str) -> dict[str, Any]:
    vm: dict[str, Any] = pal_json(env, "vm", "schedule", *flags)
    vms.append(str(vm["vmId"]))
    return vm


# A hang guard, not a speed bound: a loaded 2-core machine may take long to suspend a VM.
DEADLINE_S = 300


def wait_state(env: dict[str, str], vm_id: str, state: str) -> dict[str, Any]:
    """Poll until the VM is in ``state`` (as `pal vm get` shows it)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got: dict[str, Any] = pal_json(env, "vm", "get", vm_id)
        if got["state"] == state or time.monotonic() > deadline:
            assert got["state"] == state, f"never {state} (hang guard {DEADLINE_S} s): {got}"
            return got
        time.sleep(0.5)


def test_schedule_exec_files_ls_get_rm(user_env: dict[str, str], vms: list[str], tmp_path: Path) -> None:
    vm = schedule(user_env, vms)
    vm_id = str(vm["vmId"])
    assert vm["state"] == "running" and vm_id.strip()

    res = pal(user_env, "vm", "exec", vm_id, "--", "/bin/sh", "-c", "echo hello; echo err >&2; exit 3")
    assert (res.returncode, res.stdout, res.stderr) == (3, "hello\n", "err\n")
    # argv goes through verbatim (execve-style), flags after `--` belong to the command
    res = pal(user_env, "vm", "exec", vm_id, "--env", "GREETING=hi there", "--", "printenv", "GREETING")
    assert (res.returncode, res.stdout) == (0, "hi there\n")
    res = pal(user_env, "vm", "exec", vm_id, "--", "/bin/echo", "-n", "a b", "$HOME")
    assert res.stdout == "a b $HOME"

    # files: put from stdin and from a local file, cat, ls
    assert pal_json(user_env, "files", "put", vm_id, "notes/a.txt", stdin="line one\n") == {
        "path": "notes/a.txt",
        "bytesWritten": 9,
    }
    local = tmp_path / "job.py"
    local.write_text("print('from a script')\n")
    pal_json(user_env, "files", "put", vm_id, "notes/job.py", str(local))
    res = pal(user_env, "files", "cat", vm_id, "notes/a.txt")
    assert (res.returncode, res.stdout) == (0, "line one\n")
    listing = pal_json(user_env, "files", "ls", vm_id, "notes")
    assert sorted((e["name"], e["type"], e["size"]) for e in listing["entries"]) == [
        ("a.txt", "file", 9),
        ("job.py", "file", 23),
    ]
    # exec sees what the file commands wrote
    res = pal(user_env, "vm", "exec", vm_id, "--", "python3", "notes/job.py")
    assert (res.returncode, res.stdout) == (0, "from a script\n")
    res = pal(user_env, "files", "cat", vm_id, "notes/missing.txt")
    assert res.returncode != 0 and error_of(res)["code"].endswith("NOT_FOUND")
    assert "notes/missing.txt" in error_of(res)["message"]

    got = pal_json(user_env, "vm", "get", vm_id)
    assert got["vmId"] == vm_id and got["state"] == "running"
    listed = pal_json(user_env, "vm", "ls")
    assert [v["vmId"] for v in listed if v["state"] == "running"] == [vm_id]
    table = pal(user_env, "vm", "ls", "--table")
    assert table.returncode == 0 and "running" in table.stdout

    removed = pal_json(user_env, "vm", "rm", vm_id)
    assert removed["state"] == "terminated"
    res = pal(user_env, "vm", "exec", vm_id, "--", "true")
    assert res.returncode != 0 and error_of(res)["code"]


def test_exec_stream_prints_output_as_it_happens(user_env: dict[str, str], vms: list[str]) -> None:
    vm_id = str(schedule(user_env, vms)["vmId"])
    line = "echo first; sleep 3; echo oops >&2; echo second; exit 7"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pal.cli.main", "vm", "exec", "--stream", vm_id, "--", "/bin/sh", "-c", line],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **user_env},
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        t_first = time.monotonic()
        second = proc.stdout.readline()
        t_second = time.monotonic()
        rc = proc.wait(60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (first, second, err, rc) == ("first\n", "second\n", "oops\n", 7)
    # "first" was printed while the command was still sleeping, not at the end
    assert t_second - t_first > 2.0, (t_first, t_second)


def test_pause_resume_fork_events(user_env: dict[str, str], vms: list[str]) -> None:
    vm_id = str(schedule(user_env, vms)["vmId"])
    pal_json(user_env, "files", "put", vm_id, "state.txt", stdin="before pause\n")

    paused = pal_json(user_env, "vm", "pause", vm_id)
    assert paused["state"] == "paused" and paused["snapshotId"]
    assert pal_json(user_env, "vm", "get", vm_id)["state"] == "paused"
    # an operator-paused VM is not woken by an exec: the user is told why
    res = pal(user_env, "vm", "exec", vm_id, "--", "true")
    assert res.returncode != 0 and "paused" in res.stderr.lower()
    res = pal(user_env, "vm", "pause", vm_id)
    assert res.returncode != 0 and error_of(res)["code"]

    resumed = pal_json(user_env, "vm", "resume", vm_id)
    assert resumed == {"vmId": vm_id, "snapshotId": paused["snapshotId"], "state": "running"}
    res = pal(user_env, "files", "cat", vm_id, "state.txt")
    assert res.stdout == "before pause\n"

    # A live pause takes no snapshot: it shows none (not the previous pause's).
    live = pal_json(user_env, "vm", "pause", vm_id, "--live")
    assert live["state"] == "paused" and live["pause"]["kind"] == "live", live
    assert live["snapshotId"] is None, live
    assert pal_json(user_env, "vm", "resume", vm_id)["state"] == "running"

    forked = pal_json(user_env, "vm", "fork", vm_id, "-n", "2")
    assert forked["sourceVmId"] == vm_id
    kids = [str(f["vmId"]) for f in forked["forks"]]
    vms.extend(kids)
    assert len(set(kids)) == 2 and vm_id not in kids
    for i, kid in enumerate(kids):
        got = pal_json(user_env, "vm", "get", kid)
        assert got["state"] == "running" and got["parentVmId"] == vm_id
        res = pal(user_env, "vm", "exec", kid, "--", "/bin/sh", "-c", f"cat state.txt; echo kid{i} > own.txt")
        assert (res.returncode, res.stdout) == (0, "before pause\n")
    # a child's writes are its own
    assert pal(user_env, "files", "cat", kids[0], "own.txt").stdout == "kid0\n"
    assert pal(user_env, "files", "cat", kids[1], "own.txt").stdout == "kid1\n"
    assert pal(user_env, "files", "cat", vm_id, "own.txt").returncode != 0

    events = pal_json(user_env, "vm", "events", vm_id)
    # the VM's history, oldest first: it ran, was paused, ran again (intermediate states aside)
    settled = [e["toState"] for e in events if e.get("toState") in ("running", "paused")]
    assert settled[:3] == ["running", "paused", "running"], events


def exec_with_stdin(env: dict[str, str], stdin: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """`pal vm exec ARGS` with this stdin (a file object, a descriptor, or DEVNULL)."""
    return subprocess.run(
        [sys.executable, "-m", "pal.cli.main", "--json", "vm", "exec", *args],
        stdin=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=300,
    )


def test_exec_passes_piped_stdin_and_runs_without_one(
    user_env: dict[str, str], vms: list[str], tmp_path: Path
) -> None:
    """Input piped or redirected into exec is the command's stdin; a stdin that holds
    nothing (/dev/null, closed, empty, an idle pipe as under CI) runs the command without
    one, never waiting for input."""
    vm_id = str(schedule(user_env, vms)["vmId"])
    cmd = (vm_id, "--", "/bin/sh", "-c", "echo ran >> ran.txt; echo ran")

    # `echo 'echo hi' | pal vm exec VM -- /bin/sh`: the shell reads its script from the pipe
    r, w = os.pipe()
    os.write(w, b"echo hi; exit 4\n")
    os.close(w)
    with os.fdopen(r, "rb") as piped:
        res = exec_with_stdin(user_env, piped, vm_id, "--", "/bin/sh")
    assert (res.returncode, res.stdout) == (4, "hi\n"), res
    # `pal vm exec VM -- sh < script.sh`: from a file
    script = tmp_path / "script.sh"
    script.write_text("echo from-a-file\n")
    with script.open("rb") as f:
        res = exec_with_stdin(user_env, f, vm_id, "--", "/bin/sh")
    assert (res.returncode, res.stdout) == (0, "from-a-file\n"), res

    # stdin that holds nothing: the command runs
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    r, w = os.pipe()
    os.close(w)  # a pipe at its end (`true | pal vm exec ...`)
    idle_r, idle_w = os.pipe()  # a CI runner's stdin: open, never written
    try:
        with empty.open("rb") as f, os.fdopen(r, "rb") as at_end, os.fdopen(idle_r, "rb") as idle:
            for stdin in (subprocess.DEVNULL, f, at_end, idle):
                res = exec_with_stdin(user_env, stdin, *cmd)
                assert (res.returncode, res.stdout) == (0, "ran\n"), (stdin, res)
    finally:
        os.close(idle_w)
    # closed: `pal vm exec ... <&-`
    res = subprocess.run(
        ["bash", "-c", 'exec "$@" <&-', "-", sys.executable, "-m", "pal.cli.main", "vm", "exec", *cmd],
        capture_output=True,
        text=True,
        env={**os.environ, **user_env},
        cwd=REPO,
        timeout=300,
    )
    assert (res.returncode, res.stdout) == (0, "ran\n"), res
    assert pal(user_env, "files", "cat", vm_id, "ran.txt").stdout == "ran\n" * 5


def test_idle_timeout_suspends_and_exec_wakes(user_env: dict[str, str], vms: list[str]) -> None:
    vm = schedule(user_env, vms, "--idle-timeout", "3")
    vm_id = str(vm["vmId"])
    assert vm["idleTimeoutSecs"] == 3
    pal_json(user_env, "files", "put", vm_id, "keep.txt", stdin="kept\n")
    got = wait_state(user_env, vm_id, "paused")
    assert "idle" in str(got["reason"])
    res = pal(user_env, "vm", "exec", vm_id, "--", "cat", "keep.txt")
    assert (res.returncode, res.stdout, res.stderr) == (0, "kept\n", "")
    assert pal_json(user_env, "vm", "get", vm_id)["state"] == "running"
    kinds = [e["kind"] for e in pal_json(user_env, "vm", "events", vm_id)]
    assert "auto_resume" in kinds


def test_errors_are_clear_and_non_zero(user_env: dict[str, str], vms: list[str]) -> None:
    res = pal({**user_env, "PAL_API_KEY": "pal_not-a-real-key"}, "vm", "ls")
    assert res.returncode != 0 and res.stdout == ""
    err = error_of(res)
    assert err["code"] == "UNAUTHENTICATED" and err["message"]
    res = pal({**user_env, "PAL_API_KEY": ""}, "vm", "ls")
    assert res.returncode != 0 and error_of(res)["code"] == "UNAUTHENTICATED"

    for args in (("vm", "get", "vm-does-not-exist"), ("vm", "exec", "vm-does-not-exist", "--", "true")):
        res = pal(user_env, *args)
        assert res.returncode != 0, args
        assert error_of(res)["code"] == "NOT_FOUND", res.stderr

    vm_id = str(schedule(user_env, vms)["vmId"])
    for flags in ((), ("--stream",)):
        res = pal(user_env, "vm", "exec", *flags, vm_id, "--", "no-such-command")
        assert res.returncode != 0 and "not found" in res.stderr, (flags, res.stderr)
    res = pal(user_env, "files", "put", vm_id, "big.bin", stdin="x" * (1024 * 1024 + 1))
    assert res.returncode != 0 and error_of(res)["code"], res.stderr
    assert pal(user_env, "files", "ls", vm_id, "../etc").returncode != 0

    # nothing listening: the user is told where it tried
    dead = f"http://127.0.0.1:{free_port()}"
    res = pal({**user_env, "PAL_URL": dead}, "vm", "ls")
    assert res.returncode != 0 and dead in error_of(res)["message"]


def test_operator_commands_read_the_token_pal_up_made_in_its_data_dir(pal_server: PalServer) -> None:
    """Root on the server's host needs nothing set; elsewhere (no token at hand) it is 401."""
    token = pal_server.data_dir / "keys" / "operator.token"
    assert token.stat().st_mode & 0o777 == 0o600
    here = {"PAL_URL": pal_server.url, "PAL_DATA_DIR": str(pal_server.data_dir), "PAL_ADMIN_TOKEN": ""}
    listed = pal(here, "node", "ls")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert isinstance(json.loads(listed.stdout), list)
    elsewhere = pal({**here, "PAL_DATA_DIR": str(pal_server.data_dir / "nowhere")}, "node", "ls")
    assert elsewhere.returncode != 0
    assert "UNAUTHENTICATED" in elsewhere.stdout + elsewhere.stderr


def test_doctor_checks_the_host_store_server_and_manager(pal_server: PalServer) -> None:
    res = pal({}, "doctor", "--json", "--data-dir", str(pal_server.data_dir), "--url", pal_server.url)
    assert res.returncode == 0, res.stdout + res.stderr
    checks = {c["check"]: c for c in json.loads(res.stdout)}
    assert all(c["ok"] is not False for c in checks.values()), checks
    # doctor names the accelerator that `pal up` announced it runs on ("tcg" on these hosts)
    announced = re.search(
        r"Pal is up on \S+ \(.*accel (\w+)\)", pal_server.log_path.read_text(errors="replace")
    )
    assert announced, pal_server.log_tail()
    assert checks["accelerator"]["detail"].split()[0] == announced.group(1)
    # /healthz shows its details only to the operator's token, which doctor (root, on the
    # server's host) reads from the data dir
    assert checks["manager"]["detail"].startswith("answers (accel "), checks["manager"]
    assert checks["reflink"]["detail"].startswith("yes"), checks
    assert checks["data dir"]["detail"] == str(pal_server.data_dir)
    assert checks["store"]["detail"].startswith(str(pal_server.data_dir / "pal.db"))


def test_tenants_ls_lists_tenants_without_keys(pal_server: PalServer, user_env: dict[str, str]) -> None:
    res = pal_cli("tenants", "ls", "--data-dir", str(pal_server.data_dir))
    tenants = {t["name"]: t for t in json.loads(res.stdout)}
    assert tenants[TENANT]["maxVms"] == 6
    assert user_env["PAL_API_KEY"] not in res.stdout
    assert all("apiKey" not in t for t in tenants.values())
