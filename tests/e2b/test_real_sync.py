"""The unmodified E2B Python SDK (sync) against a real `pal up` and real VMs: two
sandboxes for the whole module (a secure one, the SDK's default, and an open one), each
test on them in turn; the pause test comes last (it pauses and resumes the secure one)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry

from pal.e2b.envd_http import FilesConfig
from pal.e2b.keys import is_e2b_key
from tests.conftest import pal_cli
from tests.e2b.conftest import RealE2b, e2b_environ


@pytest.fixture(autouse=True)
def _env(real_e2b: RealE2b) -> Iterator[None]:
    with e2b_environ(real_e2b):
        yield


@pytest.fixture(scope="module")
def sandboxes(real_e2b: RealE2b) -> Iterator[tuple[Sandbox, Sandbox]]:
    with e2b_environ(real_e2b):
        secure = Sandbox.create(
            metadata={"suite": "real-sync", "n": "1"}, envs={"GREETING": "hi"}, timeout=900
        )
        try:
            open_ = Sandbox.create(metadata={"suite": "real-sync", "n": "2"}, secure=False, timeout=900)
        except BaseException:
            secure.kill()
            raise
    try:
        yield secure, open_
    finally:
        with e2b_environ(real_e2b):
            secure.kill()
            open_.kill()


@pytest.fixture
def sbx(sandboxes: tuple[Sandbox, Sandbox]) -> Sandbox:
    return sandboxes[0]


def test_e2b_conventions(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert (info.template_id, info.metadata, info.state) == (
        "base",
        {"suite": "real-sync", "n": "1"},
        SandboxState.RUNNING,
    )
    assert sbx.commands.run("whoami; pwd; echo $HOME").stdout == "user\n/home/user\n/home/user\n"
    env = sbx.commands.run("echo $E2B_SANDBOX $E2B_SANDBOX_ID $GREETING").stdout
    assert env == f"true {sbx.sandbox_id} hi\n"
    assert sbx.commands.run("whoami; pwd", user="root").stdout == "root\n/root\n"
    assert sbx.commands.run("echo $0 $-").stdout.startswith("/bin/bash")  # bash -l -c


def test_commands(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo hello")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "", 0)
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("echo $A", envs={"A": "b"}).stdout == "b\n"
    seen: list[str] = []
    sbx.commands.run("echo to-err >&2", on_stderr=seen.append)
    assert seen == ["to-err\n"]
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 3")
    assert (failed.value.exit_code, failed.value.stdout) == (3, "partial\n")


def test_background_stdin_signals(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(handle.pid, "line one\n")
    sbx.commands.send_stdin(handle.pid, "line two\n")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "line one\nline two\n"
    sleeper = sbx.commands.run("sleep 600", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as killed:
        sleeper.wait()
    assert killed.value.exit_code == -1 and "killed" in (killed.value.error or "")
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(999999) is False


def test_pty(sbx: Sandbox) -> None:
    got = bytearray()
    done = threading.Event()

    def on_data(data: bytes) -> None:
        got.extend(data)
        if b"cols=120" in got:
            done.set()

    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
    ended: list[BaseException] = []

    def read() -> None:
        try:
            term.wait(on_pty=on_data)
        except CommandExitException as exc:  # killed: the SDK raises for its exit
            ended.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sbx.pty.send_stdin(term.pid, b"echo cols=$(tput cols 2>/dev/null || stty size | cut -d' ' -f2)\n")
    assert done.wait(120), bytes(got)
    assert sbx.pty.kill(term.pid) is True
    reader.join(60)
    assert len(ended) == 1


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("notes/a.txt", "alpha")
    assert info.path == "/home/user/notes/a.txt"
    sbx.files.write_files(
        [WriteEntry(path="/tmp/x.bin", data=b"\x00\xff\x01"), WriteEntry(path="/tmp/y.txt", data="y")]
    )
    assert sbx.files.read("/tmp/x.bin", format="bytes") == bytearray(b"\x00\xff\x01")
    assert sbx.files.read("notes/a.txt") == "alpha"
    assert sbx.commands.run("stat -c %U notes/a.txt").stdout == "user\n"  # written as the user
    assert sbx.files.exists("notes/a.txt") and not sbx.files.exists("nope.txt")
    stat = sbx.files.get_info("/tmp/x.bin")
    assert (stat.type, stat.size, stat.name) == (FileType.FILE, 3, "x.bin")
    assert {"x.bin", "y.txt"} <= {e.name for e in sbx.files.list("/tmp")}
    deep = {e.path for e in sbx.files.list("/home/user", depth=2)}
    assert "/home/user/notes/a.txt" in deep
    assert "/home/user/notes/a.txt" not in {e.path for e in sbx.files.list("/home/user")}
    assert sbx.files.make_dir("/tmp/d") is True and sbx.files.make_dir("/tmp/d") is False
    assert sbx.files.get_info("/tmp/d").type == FileType.DIR
    assert sbx.files.rename("/tmp/y.txt", "/tmp/d/y.txt").path == "/tmp/d/y.txt"
    sbx.files.remove("/tmp/d")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/d/y.txt")
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/tmp")
    big = bytes(range(256)) * 8192  # 2 MiB: more than one stdin write and one output chunk
    sbx.files.write("/tmp/big.bin", big)
    assert sbx.files.read("/tmp/big.bin", format="bytes") == big
    sbx.files.write("/root/r.txt", "root's", user="root")
    assert sbx.files.read("/root/r.txt", user="root") == "root's"
    with pytest.raises((FileNotFoundException, SandboxException)):  # /root is root's alone
        sbx.files.read("/root/r.txt")


def test_watch(sbx: Sandbox) -> None:
    """inotify in the guest (pal/guest/watches.py): each event as E2B's envd names it, a
    rename's old name, a recursive watch following a directory made under it."""
    sbx.files.make_dir("/tmp/w")
    sbx.files.write("/tmp/w/old.txt", "1")
    handle = sbx.files.watch_dir("/tmp/w", include_entry=True)
    deep = sbx.files.watch_dir("/tmp/w", recursive=True)
    sbx.files.write("/tmp/w/new.txt", "2")
    sbx.files.remove("/tmp/w/old.txt")
    sbx.files.make_dir("/tmp/w/sub")
    sbx.files.write("/tmp/w/sub/a.txt", "a")
    sbx.files.rename("/tmp/w/sub/a.txt", "/tmp/w/sub/b.txt")
    events = handle.get_new_events()
    handle.stop()
    C, W, REM, REN = (
        FilesystemEventType.CREATE,
        FilesystemEventType.WRITE,
        FilesystemEventType.REMOVE,
        FilesystemEventType.RENAME,
    )
    flat = {(e.name, e.type) for e in events}
    assert flat == {("new.txt", C), ("new.txt", W), ("old.txt", REM), ("sub", C)}
    made = next(e for e in events if e.name == "new.txt" and e.type == C)
    assert made.entry is not None and made.entry.type == FileType.FILE
    got = {(e.name, e.type) for e in deep.get_new_events()}
    deep.stop()
    assert {("sub", C), ("sub/a.txt", C), ("sub/a.txt", REN), ("sub/b.txt", C)} <= got, got
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir("/tmp/missing")


def test_list_filters_pages_and_timeout(sandboxes: tuple[Sandbox, Sandbox]) -> None:
    secure, open_ = sandboxes
    paginator = Sandbox.list(query=SandboxQuery(metadata={"suite": "real-sync"}), limit=1)
    first = paginator.next_items()
    assert len(first) == 1 and paginator.has_next
    second = paginator.next_items()
    assert {s.sandbox_id for s in first + second} == {secure.sandbox_id, open_.sandbox_id}
    assert not paginator.has_next
    only = Sandbox.list(query=SandboxQuery(metadata={"suite": "real-sync", "n": "2"})).next_items()
    assert [s.sandbox_id for s in only] == [open_.sandbox_id]
    open_.set_timeout(1200)
    info = open_.get_info()
    assert 1150 <= (info.end_at - info.started_at).total_seconds() <= 1200 + 600


def test_an_open_sandbox_and_a_secure_one(sandboxes: tuple[Sandbox, Sandbox], real_e2b: RealE2b) -> None:
    secure, open_ = sandboxes
    assert open_._envd_access_token is None and secure._envd_access_token
    assert open_.commands.run("echo open").stdout == "open\n"
    url = f"http://127.0.0.1:{real_e2b.server.e2b_port}/files"
    secure.files.write("/tmp/s.txt", "secret")
    headers = {"E2b-Sandbox-Id": secure.sandbox_id}
    assert httpx.get(url, params={"path": "/tmp/s.txt"}, headers=headers).status_code == 401
    signed = httpx.get(secure.download_url("/tmp/s.txt", use_signature_expiration=600), headers=headers)
    assert signed.status_code == 200 and signed.content == b"secret"


def test_another_tenants_sandbox_is_not_found(sbx: Sandbox, real_e2b: RealE2b) -> None:
    from e2b import SandboxNotFoundException

    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id, api_key=real_e2b.other_key)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=real_e2b.other_key)
    assert Sandbox.kill(sbx.sandbox_id, api_key=real_e2b.other_key) is False
    assert sbx.is_running()


def test_file_metadata(sbx: Sandbox) -> None:
    """E2B's file metadata: real ``user.e2b.*`` xattrs on the guest's file, shown by
    get_info and list; each upload replaces it (none sent: cleared); a file over 1 MiB (the
    ``cat`` path) and root's keep it too; bad metadata is E2B's 400 before the file is
    written; the guest's /tmp (a tmpfs of its 6.1 kernel: no user xattrs) says so."""
    meta = {"Owner": "ann", "stage": "draft v2"}
    want = {"owner": "ann", "stage": "draft v2"}  # keys lowercased, as envd does
    assert sbx.files.write("meta/a.txt", "alpha", metadata=meta).metadata == want
    assert sbx.files.get_info("meta/a.txt").metadata == want
    sbx.files.write("meta/plain.txt", "no metadata")
    listed = {e.name: e.metadata for e in sbx.files.list("meta")}
    assert listed == {"a.txt": want, "plain.txt": None}
    # Real xattrs of the guest's file system, read by the guest's own python3.
    show = (
        "import os; f = 'meta/a.txt'; print(sorted((n, os.getxattr(f, n).decode()) for n in os.listxattr(f)))"
    )
    out = sbx.commands.run(f'python3 -c "{show}"').stdout
    assert out == "[('user.e2b.owner', 'ann'), ('user.e2b.stage', 'draft v2')]\n"
    assert sbx.files.write("meta/a.txt", "beta", metadata={"stage": "final"}).metadata == {"stage": "final"}
    assert sbx.files.get_info("meta/a.txt").metadata == {"stage": "final"}
    sbx.files.write("meta/a.txt", "gamma")  # no metadata: none left
    assert sbx.files.get_info("meta/a.txt").metadata is None
    big = b"m" * (1024 * 1024 + 1)  # past Pal's files verb: a ``cat`` process, then the xattrs
    assert sbx.files.write("meta/big.bin", big, metadata={"k": "v"}).metadata == {"k": "v"}
    assert sbx.files.get_info("meta/big.bin").metadata == {"k": "v"}
    sbx.files.write("/root/m.txt", "root's", user="root", metadata={"who": "root"})
    assert sbx.files.get_info("/root/m.txt", user="root").metadata == {"who": "root"}
    assert sbx.files.rename("meta/big.bin", "meta/moved.bin").metadata == {"k": "v"}
    with pytest.raises(InvalidArgumentException, match="4096"):
        sbx.files.write("meta/huge-meta.txt", "x", metadata={"k": "v" * 5000})
    with pytest.raises(InvalidArgumentException, match="246"):
        sbx.files.write("meta/long-key.txt", "x", metadata={"k" * 247: "v"})
    assert not sbx.files.exists("meta/huge-meta.txt") and not sbx.files.exists("meta/long-key.txt")
    with pytest.raises(InvalidArgumentException, match="xattrs"):
        sbx.files.write("/tmp/m.txt", "x", metadata={"k": "v"})
    sbx.files.write("/tmp/m.txt", "y")  # without metadata: fine there
    assert sbx.files.get_info("/tmp/m.txt").metadata is None


def test_a_huge_upload_is_refused_before_it_is_read(sbx: Sandbox, real_e2b: RealE2b) -> None:
    bound = FilesConfig().max_upload_bytes
    with socket.create_connection(("127.0.0.1", real_e2b.server.e2b_port), timeout=120) as conn:
        conn.sendall(
            b"POST /files?path=/tmp/huge HTTP/1.1\r\nHost: x\r\n"
            + f"E2b-Sandbox-Id: {sbx.sandbox_id}\r\nX-Access-Token: {sbx._envd_access_token}\r\n".encode()
            + f"Content-Type: application/octet-stream\r\nContent-Length: {bound + 1}\r\n\r\n".encode()
            + b"x" * 100
        )
        status_line = conn.makefile("rb").readline()
    assert status_line.split()[1] == b"413"
    assert not sbx.files.exists("/tmp/huge")


def test_metrics(sbx: Sandbox) -> None:
    samples = sbx.get_metrics()
    assert isinstance(samples, list)
    for s in samples:
        assert s.cpu_count >= 1 and s.mem_total > 0 and 0 <= s.cpu_used_pct


def test_pause_connect_loses_no_output(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/pw")
    watch = sbx.files.watch_dir("/tmp/pw")  # a polling watcher: it lives in the guest
    sbx.files.write("/tmp/pw/before.txt", "b")
    counter = sbx.commands.run(
        "i=0; while [ $i -lt 100 ]; do echo line$i; i=$((i+1)); sleep 0.05; done", background=True
    )
    before: list[str] = []
    started = threading.Event()

    def read() -> None:
        def seen(text: str) -> None:
            before.append(text)
            started.set()

        try:
            counter.wait(on_stdout=seen)
        except Exception:  # its stream breaks at the pause
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(120)
    assert sbx.pause() is True
    reader.join(120)
    assert not sbx.is_running()
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.get_info().state == SandboxState.RUNNING
    after = again.commands.connect(counter.pid).wait()
    lines = ("".join(before) + after.stdout).splitlines()
    assert lines == [f"line{i}" for i in range(100)]
    assert again.commands.run("echo back").stdout == "back\n"
    again.files.write("/tmp/pw/after.txt", "a")
    created = {e.name for e in watch.get_new_events() if e.type == FilesystemEventType.CREATE}
    assert created == {"before.txt", "after.txt"}  # what it saw before the pause, and after
    watch.stop()


def test_fork(sandboxes: tuple[Sandbox, Sandbox]) -> None:
    _, open_ = sandboxes
    open_.files.write("forked.txt", "before the fork")
    (child,) = Sandbox.fork(open_.sandbox_id, count=1)
    assert isinstance(child, Sandbox), child
    try:
        assert child.sandbox_id != open_.sandbox_id
        assert child.files.read("forked.txt") == "before the fork"
        assert child.commands.run("whoami").stdout == "user\n"
        assert child.get_info().metadata == {"suite": "real-sync", "n": "2"}
    finally:
        assert child.kill() is True


def test_kill(sandboxes: tuple[Sandbox, Sandbox]) -> None:
    _, open_ = sandboxes
    assert open_.kill() is True
    assert Sandbox.kill(open_.sandbox_id) is False
    assert not open_.is_running()


def test_pal_e2b_env_makes_one_key_per_machine(real_e2b: RealE2b, tenant_key: str, tmp_path: Path) -> None:
    env = {"PAL_URL": real_e2b.server.url, "PAL_API_KEY": tenant_key, "HOME": str(tmp_path)}
    first = pal_cli("e2b", "env", env=env).stdout
    lines = dict(line.removeprefix("export ").split("=", 1) for line in first.splitlines())
    assert lines["E2B_API_URL"] == real_e2b.server.url + "/e2b" and "E2B_VALIDATE_API_KEY" not in lines
    key = lines["E2B_API_KEY"]
    assert is_e2b_key(key)
    assert pal_cli("e2b", "env", env=env).stdout == first  # kept: the same key again
    assert isinstance(Sandbox.list(api_key=key).next_items(), list)
    listed = json.loads(
        pal_cli("tenants", "keys", "ls", "it-main", "--data-dir", str(real_e2b.server.data_dir)).stdout
    )
    (mine,) = [k for k in listed if k["mask"] == f"{key[:8]}...{key[-4:]}"]
    pal_cli("tenants", "keys", "revoke", "it-main", mine["id"], "--data-dir", str(real_e2b.server.data_dir))
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=key).next_items()
