"""envd's ``filesystem.Filesystem`` Connect service over :class:`ops.FilesystemOps`."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt import Timestamp

from . import ops
from .gen import filesystem_pb as pb
from .streams import caller, stream, unary

MAX_DEPTH = 64
MAX_PATH_BYTES = 4096

_FILE_TYPE = {
    ops.FileType.FILE: pb.FileType.FILE,
    ops.FileType.DIRECTORY: pb.FileType.DIRECTORY,
    ops.FileType.SYMLINK: pb.FileType.SYMLINK,
}


def _path(path: str, what: str = "path") -> str:
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, f"{what} is required")
    if len(path.encode()) > MAX_PATH_BYTES or "\x00" in path:
        raise ConnectError(Code.INVALID_ARGUMENT, f"{what} is not a usable path")
    return path


def entry_info(e: ops.Entry) -> pb.EntryInfo:
    return pb.EntryInfo(
        name=e.name,
        type=_FILE_TYPE[e.type],
        path=e.path,
        size=e.size,
        mode=e.mode,
        permissions=e.permissions,
        owner=e.owner,
        group=e.group,
        modified_time=Timestamp.from_datetime(e.modified_time) if e.modified_time is not None else None,
        symlink_target=e.symlink_target,
        metadata=dict(e.metadata),
    )


def fs_event(event: ops.FsEvent) -> pb.FilesystemEvent:
    return pb.FilesystemEvent(
        name=event.name,
        type=pb.EventType(event.type.value),
        entry=entry_info(event.entry) if event.entry is not None else None,
    )


def _watch_message(event: ops.FsEvent) -> pb.WatchDirResponse:
    W = pb.WatchDirResponse
    return W(event=Oneof[Literal["filesystem"], pb.FilesystemEvent]("filesystem", fs_event(event)))


def _watch_keepalive() -> pb.WatchDirResponse:
    W = pb.WatchDirResponse
    return W(event=Oneof[Literal["keepalive"], pb.WatchDirResponse.KeepAlive]("keepalive", W.KeepAlive()))


def _watch(path: str, recursive: bool, include_entry: bool) -> ops.Watch:
    return ops.Watch(path=_path(path), recursive=recursive, include_entry=include_entry)


class FilesystemService:
    """Implements the generated ``filesystem_connect.Filesystem`` protocol."""

    def __init__(self, files: ops.FilesystemOps) -> None:
        self.files = files

    async def stat(self, request: pb.StatRequest, ctx: RequestContext[Any, Any]) -> pb.StatResponse:
        entry = await unary(functools.partial(self.files.stat, caller(ctx), _path(request.path)))
        return pb.StatResponse(entry=entry_info(entry))

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any]) -> pb.MakeDirResponse:
        entry = await unary(functools.partial(self.files.make_dir, caller(ctx), _path(request.path)))
        return pb.MakeDirResponse(entry=entry_info(entry))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext[Any, Any]) -> pb.MoveResponse:
        source, destination = _path(request.source, "source"), _path(request.destination, "destination")
        entry = await unary(functools.partial(self.files.move, caller(ctx), source, destination))
        return pb.MoveResponse(entry=entry_info(entry))

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any]) -> pb.ListDirResponse:
        depth = int(request.depth) or 1  # 0 (unset) lists one level, as envd does
        if depth > MAX_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth at most {MAX_DEPTH}")
        found = await unary(functools.partial(self.files.list_dir, caller(ctx), _path(request.path), depth))
        return pb.ListDirResponse(entries=[entry_info(e) for e in found])

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any]) -> pb.RemoveResponse:
        await unary(functools.partial(self.files.remove, caller(ctx), _path(request.path)))
        return pb.RemoveResponse()

    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.WatchDirResponse]:
        who = caller(ctx)
        watch = _watch(request.path, request.recursive, request.include_entry)
        # The watch is in place (or its error raised: a missing directory) before the start
        # event goes out, so no change after the SDK's watch_dir() returned is missed.
        events = await unary(functools.partial(self.files.watch, who, watch))
        W = pb.WatchDirResponse
        yield W(event=Oneof[Literal["start"], pb.WatchDirResponse.StartEvent]("start", W.StartEvent()))
        async for message in stream(ctx, events, _watch_message, _watch_keepalive):
            yield message

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> pb.CreateWatcherResponse:
        watch = _watch(request.path, request.recursive, request.include_entry)
        watcher_id = await unary(functools.partial(self.files.create_watcher, caller(ctx), watch))
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
    ) -> pb.GetWatcherEventsResponse:
        found = await unary(functools.partial(self.files.watcher_events, caller(ctx), request.watcher_id))
        return pb.GetWatcherEventsResponse(events=[fs_event(e) for e in found])

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> pb.RemoveWatcherResponse:
        await unary(functools.partial(self.files.remove_watcher, caller(ctx), request.watcher_id))
        return pb.RemoveWatcherResponse()
