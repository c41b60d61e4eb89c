"""Buffered exec keeps at most 8 MiB per stream and says it cut."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pal.api.exec_stream import BUFFERED_OUTPUT_MAX, buffered_exec
from pal.manager.models import ExecEvent


async def _events(chunks: int, size: int) -> AsyncIterator[ExecEvent]:
    for _ in range(chunks):
        yield ExecEvent(type="stdout", data="x" * size)
    yield ExecEvent(type="stderr", data="small")
    yield ExecEvent(type="exit", exit_code=0)


async def test_buffered_exec_output_is_capped_and_flagged() -> None:
    out = await buffered_exec(_events(chunks=20, size=1024 * 1024))
    assert len(out.stdout) == BUFFERED_OUTPUT_MAX
    assert out.stderr == "small" and out.exit_code == 0
    assert out.truncated is True


async def test_small_output_is_whole_and_not_flagged() -> None:
    out = await buffered_exec(_events(chunks=2, size=10))
    assert out.stdout == "x" * 20 and out.truncated is None
