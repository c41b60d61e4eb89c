"""The unmodified E2B Python SDK (sync) against Pal's E2B surface (over tests/e2b/fake.py):
what it sends, what it gets, which exceptions it raises."""

from __future__ import annotations

import gzip
import os
import socket
import threading

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
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry

from pal.e2b.versions import ENVD_VERSION
from tests.e2b.conftest import MAX_UPLOAD, E2bServer


@pytest.fixture
def sbx(e2b_env: E2bServer) -> Sandbox:
    return Sandbox.create(metadata={"suite": "py"}, envs={"GREETING": "hi"}, timeout=120)


def test_create_answers_what_the_sdk_needs(sbx: Sandbox, e2b_env: E2bServer) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.template_id == "base"
    assert info.metadata == {"suite": "py"}
    assert info.state == SandboxState.RUNNING
    assert info.envd_version == ENVD_VERSION
    assert (info.end_at - info.started_at).total_seconds() == 120
    assert sbx._envd_access_token  # secure by default: the SDK got a token to send
    assert sbx.is_running()


def test_a_key_of_the_wrong_form_never_leaves_the_client(e2b_env: E2bServer) -> None:
    with pytest.raises(AuthenticationException, match="Invalid API key format"):
        Sandbox.create(api_key="pal_notanE2Bkey")


def test_an_unknown_key_is_authentication_error(e2b_env: E2bServer) -> None:
    with pytest.raises(AuthenticationException, match="401"):
        Sandbox.create(api_key="e2b_" + "0" * 40)


def test_unknown_template_is_an_error_with_the_message(e2b_env: E2bServer) -> None:
    with pytest.raises(SandboxException, match="404: template 'nope' not found"):
        Sandbox.create("nope")


def test_other_tenants_sandbox_is_not_found(sbx: Sandbox, e2b_env: E2bServer) -> None:
    from e2b import SandboxNotFoundException

    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id, api_key=e2b_env.other_key)
    assert Sandbox.kill(sbx.sandbox_id, api_key=e2b_env.other_key) is False
    assert sbx.is_running()


def test_list_filters_and_pages(e2b_env: E2bServer) -> None:
    made = [Sandbox.create(metadata={"batch": "pages", "i": str(i)}) for i in range(3)]
    paginator = Sandbox.list(query=SandboxQuery(metadata={"batch": "pages"}), limit=2)
    first = paginator.next_items()
    assert len(first) == 2 and paginator.has_next
    second = paginator.next_items()
    assert not paginator.has_next
    assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in made}
    made[0].pause()
    paused = Sandbox.list(query=SandboxQuery(metadata={"batch": "pages"}, state=[SandboxState.PAUSED]))
    assert [s.sandbox_id for s in paused.next_items()] == [made[0].sandbox_id]


def test_timeout_pause_connect_kill(sbx: Sandbox, e2b_env: E2bServer) -> None:
    sbx.set_timeout(600)
    assert (sbx.get_info().end_at - sbx.get_info().started_at).total_seconds() == 600
    assert sbx.pause() is True
    assert sbx.pause() is False  # already paused: 409
    assert not sbx.is_running()  # the agent answers 502 for a sandbox that is not running
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.get_info().state == SandboxState.RUNNING
    assert again.commands.run("echo back").stdout == "back\n"
    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_fork_reports_each_outcome(sbx: Sandbox, e2b_env: E2bServer) -> None:
    sbx.files.write("/home/user/a.txt", "forked")
    results = Sandbox.fork(sbx.sandbox_id, count=3)
    children = [r for r in results if isinstance(r, Sandbox)]
    assert len(children) == 2
    assert isinstance(results[2], RateLimitException)
    assert children[0].files.read("/home/user/a.txt") == "forked"


def test_metrics(sbx: Sandbox) -> None:
    samples = sbx.get_metrics()
    assert [s.cpu_used_pct for s in samples] == [0.0, 12.5, 25.0]
    assert samples[0].mem_total == 512 << 20


def test_commands_run_and_fail(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo hello")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "", 0)
    assert sbx.commands.run("env GREETING").stdout == "hi\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    seen: list[str] = []
    sbx.commands.run("echo to-err >&2", on_stderr=seen.append)
    assert seen == ["to-err\n"]
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("exit 3")
    assert failed.value.exit_code == 3


def test_background_stdin_list_connect_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(handle.pid, "line one\n")
    attached = sbx.commands.connect(handle.pid)
    sbx.commands.send_stdin(handle.pid, "line two\n")
    sbx.commands.close_stdin(handle.pid)
    assert attached.wait().stdout == "line two\n"
    assert handle.wait().stdout == "line one\nline two\n"
    sleeper = sbx.commands.run("sleep", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sbx.commands.kill(99999) is False


def test_pty(sbx: Sandbox) -> None:
    got = bytearray()
    done = threading.Event()

    def on_data(data: bytes) -> None:
        got.extend(data)
        if b"ls\n" in got:
            done.set()

    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(term.pid, b"ls\n")
    ended: list[BaseException] = []

    def read() -> None:
        try:
            term.wait(on_pty=on_data)
        except CommandExitException as exc:  # killed: the SDK raises for its exit
            ended.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert done.wait(10)
    assert sbx.pty.kill(term.pid) is True
    reader.join(10)
    assert len(ended) == 1


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("notes/a.txt", "alpha", metadata={"Owner": "me"})
    assert info.path == "/home/user/notes/a.txt"
    sbx.files.write_files(
        [WriteEntry(path="/tmp/x.bin", data=b"\x00\x01"), WriteEntry(path="/tmp/y.txt", data="y")]
    )
    assert sbx.files.read("/tmp/x.bin", format="bytes") == bytearray(b"\x00\x01")
    assert sbx.files.read("notes/a.txt", gzip=True) == "alpha"
    sbx.files.write("/tmp/z.txt", "zipped", gzip=True)
    assert sbx.files.read("/tmp/z.txt") == "zipped"
    assert sbx.files.get_info("notes/a.txt").metadata == {"owner": "me"}
    assert sbx.files.exists("notes/a.txt") and not sbx.files.exists("nope.txt")
    names = {e.name for e in sbx.files.list("/tmp")}
    assert {"x.bin", "y.txt", "z.txt"} <= names
    deep = {e.path for e in sbx.files.list("/home/user", depth=2)}
    assert "/home/user/notes/a.txt" in deep
    assert "/home/user/notes/a.txt" not in {e.path for e in sbx.files.list("/home/user")}
    assert sbx.files.make_dir("/tmp/d") is True and sbx.files.make_dir("/tmp/d") is False
    assert sbx.files.get_info("/tmp/d").type == FileType.DIR
    moved = sbx.files.rename("/tmp/y.txt", "/tmp/d/y.txt")
    assert moved.path == "/tmp/d/y.txt"
    sbx.files.remove("/tmp/d/y.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/d/y.txt")
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/tmp")


def test_watch(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/w")
    handle = sbx.files.watch_dir("/tmp/w", include_entry=True)
    sbx.files.write("/tmp/w/new.txt", "1")
    sbx.files.remove("/tmp/w/new.txt")
    events = []
    for _ in range(50):
        events += handle.get_new_events()
        if len(events) >= 2:
            break
    handle.stop()
    assert [(e.name, e.type) for e in events] == [
        ("new.txt", FilesystemEventType.CREATE),
        ("new.txt", FilesystemEventType.REMOVE),
    ]
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir("/tmp/missing")


def test_secure_sandbox_needs_its_token(sbx: Sandbox, e2b_env: E2bServer) -> None:
    sbx.files.write("/tmp/s.txt", "secret")
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id}
    plain = httpx.get(f"{e2b_env.sandbox_url}/files", params={"path": "/tmp/s.txt"}, headers=headers)
    assert plain.status_code == 401
    signed = httpx.get(sbx.download_url("/tmp/s.txt", use_signature_expiration=60), headers=headers)
    assert signed.status_code == 200 and signed.content == b"secret"
    forged = httpx.get(sbx.download_url("/tmp/other.txt"), params={"path": "/tmp/s.txt"}, headers=headers)
    assert forged.status_code == 401
    upload = httpx.post(
        sbx.upload_url("/tmp/up.txt"), files={"file": ("/tmp/up.txt", b"up")}, headers=headers
    )
    assert upload.status_code == 200, upload.text
    assert sbx.files.read("/tmp/up.txt") == "up"


def test_an_insecure_sandbox_takes_calls_by_its_id(e2b_env: E2bServer) -> None:
    sbx = Sandbox.create(secure=False)
    assert sbx._envd_access_token is None
    assert sbx.commands.run("echo open").stdout == "open\n"


def test_a_killed_sandbox_is_a_timeout_to_the_agent(sbx: Sandbox) -> None:
    sbx.kill()
    assert not sbx.is_running()
    with pytest.raises(TimeoutException):
        sbx.commands.run("echo late")
    with pytest.raises(TimeoutException):
        sbx.files.read("/tmp/anything")


def test_a_huge_upload_is_refused_before_it_is_read(sbx: Sandbox, e2b_env: E2bServer) -> None:
    # Headers announcing more than the bound and a few bytes of body: the 413 must come
    # without the server waiting for the rest (it would wait forever: it never comes).
    port = int(e2b_env.sandbox_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(
            b"POST /files?path=/tmp/big HTTP/1.1\r\nHost: x\r\n"
            + f"E2b-Sandbox-Id: {sbx.sandbox_id}\r\nX-Access-Token: {sbx._envd_access_token}\r\n".encode()
            + f"Content-Type: application/octet-stream\r\nContent-Length: {MAX_UPLOAD + 1}\r\n\r\n".encode()
            + b"x" * 100
        )
        status_line = conn.makefile("rb").readline()
    assert status_line.split()[1] == b"413"
    # Through the SDK: its 413, or (the server answered and closed before the client was done
    # sending, seen under load) the connection reset under the rest of the body.
    with pytest.raises((SandboxException, httpx.TransportError)) as refused:
        sbx.files.write("/tmp/big", b"x" * (MAX_UPLOAD + 1))
    assert isinstance(refused.value, httpx.TransportError) or "413" in str(refused.value)
    assert not sbx.files.exists("/tmp/big")


def test_a_refused_small_upload_is_answered_not_reset(sbx: Sandbox) -> None:
    """An upload refused on its headers (metadata past envd's bounds) gets its 400 every
    time: a server that answers and closes with the body unread resets the connection,
    and the client, still sending or reading, sees a transport error instead."""
    for i in range(30):
        with pytest.raises(InvalidArgumentException, match="4096"):
            sbx.files.write(f"/tmp/refused-{i}", os.urandom(512 * 1024), metadata={"k": "v" * 5000})
    assert not sbx.files.exists("/tmp/refused-0")


def test_an_inflating_gzip_upload_is_bounded(sbx: Sandbox, e2b_env: E2bServer) -> None:
    bomb = gzip.compress(b"\0" * (MAX_UPLOAD + 1))
    assert len(bomb) < MAX_UPLOAD // 100
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": sbx._envd_access_token or "",
        "Content-Type": "application/octet-stream",
        "Content-Encoding": "gzip",
    }
    answer = httpx.post(
        f"{e2b_env.sandbox_url}/files", params={"path": "/tmp/bomb"}, headers=headers, content=bomb
    )
    assert answer.status_code == 413
    assert not sbx.files.exists("/tmp/bomb")


@pytest.mark.parametrize(
    ("accept", "data", "gzipped"),
    [
        ("gzip", b"the same line again\n" * 4096, True),
        ("gzip, deflate", b"the same line again\n" * 4096, True),
        ("*", b"the same line again\n" * 4096, True),
        ("gzip;q=0, identity", b"the same line again\n" * 4096, False),
        ("identity", b"the same line again\n" * 4096, False),
        # Random bytes do not shrink: gzip would cost both ends CPU for nothing.
        ("gzip", os.urandom(1 << 20), False),
    ],
)
def test_a_download_is_gzip_when_the_client_takes_it_and_it_pays(
    sbx: Sandbox, e2b_env: E2bServer, accept: str, data: bytes, gzipped: bool
) -> None:
    sbx.files.write("/tmp/dl.bin", data)
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": sbx._envd_access_token or "",
        "Accept-Encoding": accept,
    }
    with httpx.stream(
        "GET", f"{e2b_env.sandbox_url}/files", params={"path": "/tmp/dl.bin"}, headers=headers
    ) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    assert r.headers.get("content-encoding") == ("gzip" if gzipped else None)
    assert (gzip.decompress(raw) if gzipped else raw) == data
    assert len(raw) < len(data) // 10 if gzipped else len(raw) == len(data)
    assert sbx.files.read("/tmp/dl.bin", format="bytes", gzip=True) == bytearray(data)
