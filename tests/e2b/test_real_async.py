"""The unmodified E2B Python SDK (async) against a real `pal up` and a real VM: one
sandbox, the async paths of the calls the sync module covers at length."""

from __future__ import annotations

import asyncio

import pytest
from e2b import AsyncSandbox, CommandExitException, FilesystemEvent, FilesystemEventType, SandboxState

from tests.e2b.conftest import RealE2b, e2b_environ


async def test_async_sdk_on_a_real_sandbox(real_e2b: RealE2b) -> None:
    with e2b_environ(real_e2b):
        sbx = await AsyncSandbox.create(metadata={"suite": "real-async"}, timeout=600)
        try:
            assert (await sbx.get_info()).state == SandboxState.RUNNING
            assert (await sbx.commands.run("echo async; whoami")).stdout == "async\nuser\n"
            with pytest.raises(CommandExitException):
                await sbx.commands.run("exit 2")
            handle = await sbx.commands.run("cat", background=True, stdin=True)
            await sbx.commands.send_stdin(handle.pid, "in\n")
            await sbx.commands.close_stdin(handle.pid)
            assert (await handle.wait()).stdout == "in\n"
            await sbx.files.write("/tmp/a.bin", b"\x00async")
            assert await sbx.files.read("/tmp/a.bin", format="bytes") == bytearray(b"\x00async")
            assert [e.name for e in await sbx.files.list("/tmp") if e.name == "a.bin"] == ["a.bin"]
            await sbx.files.make_dir("/tmp/aw")
            seen: list[tuple[str, FilesystemEventType]] = []
            arrived = asyncio.Event()

            def on_event(event: FilesystemEvent) -> None:
                seen.append((event.name, event.type))
                arrived.set()

            watch = await sbx.files.watch_dir("/tmp/aw", on_event)
            await sbx.files.write("/tmp/aw/f.txt", "1")
            await asyncio.wait_for(arrived.wait(), 300)  # a hang guard, not a speed bound
            await watch.stop()
            assert seen[0] == ("f.txt", FilesystemEventType.CREATE)
            listed = await (AsyncSandbox.list()).next_items()
            assert sbx.sandbox_id in {s.sandbox_id for s in listed}
        finally:
            assert await sbx.kill() is True
        assert await AsyncSandbox.kill(sbx.sandbox_id) is False
