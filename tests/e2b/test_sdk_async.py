"""The unmodified E2B Python SDK (async) and e2b-code-interpreter against Pal's E2B
surface (over tests/e2b/fake.py). The async SDK watches with the WatchDir stream (the sync
one polls), so its keepalives and start event are exercised here."""

from __future__ import annotations

import asyncio

import pytest
from e2b import AsyncSandbox, CommandExitException, FilesystemEventType, NotFoundException
from e2b_code_interpreter import AsyncSandbox as AsyncCodeSandbox
from e2b_code_interpreter import Sandbox as CodeSandbox

from tests.e2b.conftest import E2bServer


async def test_async_commands_files_and_watch(e2b_env: E2bServer) -> None:
    sbx = await AsyncSandbox.create(metadata={"suite": "async"})
    assert (await sbx.commands.run("echo async")).stdout == "async\n"
    with pytest.raises(CommandExitException):
        await sbx.commands.run("exit 2")
    handle = await sbx.commands.run("cat", background=True, stdin=True)
    await sbx.commands.send_stdin(handle.pid, "in\n")
    await sbx.commands.close_stdin(handle.pid)
    assert (await handle.wait()).stdout == "in\n"

    await sbx.files.make_dir("/tmp/aw")
    seen: list[tuple[str, FilesystemEventType]] = []
    arrived = asyncio.Event()

    def on_event(event: object) -> None:
        seen.append((event.name, event.type))  # type: ignore[attr-defined]
        if len(seen) == 2:
            arrived.set()

    watch = await sbx.files.watch_dir("/tmp/aw", on_event, recursive=True)
    await sbx.files.write("/tmp/aw/f.txt", "1")
    await sbx.files.write("/tmp/aw/f.txt", "2")
    await asyncio.wait_for(arrived.wait(), 30)
    await watch.stop()
    assert seen == [("f.txt", FilesystemEventType.CREATE), ("f.txt", FilesystemEventType.WRITE)]
    with pytest.raises(NotFoundException):
        await sbx.files.watch_dir("/tmp/none", on_event)
    assert await sbx.kill() is True


def test_code_interpreter_sync(e2b_env: E2bServer) -> None:
    sbx = CodeSandbox.create()
    first = sbx.run_code("1 + 1")
    assert first.text == "1 + 1" and first.execution_count == 1
    assert first.results[0].png == "iVBORw0KGgo=" and first.results[0].is_main_result
    assert sbx.run_code("x").execution_count == 2  # state across cells: one default context
    printed = sbx.run_code("print('hi')")
    assert printed.logs.stdout == ["hi\n"]
    failed = sbx.run_code("raise boom")
    assert failed.error is not None and (failed.error.name, failed.error.value) == ("ValueError", "boom")
    ctx = sbx.create_code_context(cwd="/tmp")
    assert (ctx.language, ctx.cwd) == ("python", "/tmp")
    assert sbx.run_code("y", context=ctx).execution_count == 1
    assert [c.id for c in sbx.list_code_contexts()] == [ctx.id]
    sbx.restart_code_context(ctx)
    sbx.remove_code_context(ctx)
    assert sbx.list_code_contexts() == []
    with pytest.raises(NotFoundException):
        sbx.run_code("z", context=ctx)


async def test_code_interpreter_async(e2b_env: E2bServer) -> None:
    sbx = await AsyncCodeSandbox.create()
    got: list[str] = []
    execution = await sbx.run_code("print('streamed')", on_stdout=lambda m: got.append(m.line))
    assert got == ["streamed\n"] and execution.logs.stdout == ["streamed\n"]
    await sbx.kill()
