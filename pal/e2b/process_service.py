"""envd's ``process.Process`` Connect service over :class:`ops.ProcessOps`.

Each method turns its request into an operation's arguments, and the operation's events or
answer into the messages of ``gen/process_pb.py``; nothing here keeps a process or any
state (processes.py binds the operations to Pal's processes and their journals).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from . import ops
from .gen import process_pb as pb
from .streams import caller, stream, unary

MAX_ARGS = 4096
MAX_ENVS = 1024
MAX_PTY_SIDE = 4096


def _invalid(message: str) -> ConnectError:
    return ConnectError(Code.INVALID_ARGUMENT, message)


def process_ref(selector: pb.ProcessSelector | None) -> ops.ProcessRef:
    chosen = selector.selector if selector is not None else None
    if chosen is None:
        raise _invalid("name the process by its pid or its tag")
    if chosen.field == "pid":
        return ops.ProcessRef(pid=int(chosen.value))
    return ops.ProcessRef(tag=str(chosen.value))


def _pty_size(pty: pb.PTY | None) -> tuple[int, int] | None:
    if pty is None:
        return None
    size = pty.size or pb.PTY.Size()
    cols, rows = int(size.cols), int(size.rows)
    if not (1 <= cols <= MAX_PTY_SIDE and 1 <= rows <= MAX_PTY_SIDE):
        raise _invalid(f"terminal size {cols}x{rows} out of range (1..{MAX_PTY_SIDE})")
    return cols, rows


def process_spec(request: pb.StartRequest) -> ops.ProcessSpec:
    config = request.process
    if config is None or not config.cmd:
        raise _invalid("process.cmd is required")
    if len(config.args) > MAX_ARGS or len(config.envs) > MAX_ENVS:
        raise _invalid(f"at most {MAX_ARGS} args and {MAX_ENVS} envs")
    return ops.ProcessSpec(
        cmd=config.cmd,
        args=tuple(config.args),
        envs=dict(config.envs),
        cwd=config.cwd if config.has_field("cwd") else None,
        tag=request.tag if request.has_field("tag") else None,
        pty=_pty_size(request.pty) if request.has_field("pty") else None,
        stdin=request.stdin if request.has_field("stdin") else True,
    )


def _output(event: ops.ProcessOutput) -> pb.ProcessEvent.DataEvent:
    # Oneof's field name must be a literal for the generated types: one branch each.
    if event.stream == "stdout":
        return pb.ProcessEvent.DataEvent(output=Oneof[Literal["stdout"], bytes]("stdout", event.data))
    if event.stream == "stderr":
        return pb.ProcessEvent.DataEvent(output=Oneof[Literal["stderr"], bytes]("stderr", event.data))
    return pb.ProcessEvent.DataEvent(output=Oneof[Literal["pty"], bytes]("pty", event.data))


def process_event(event: ops.ProcessEvent) -> pb.ProcessEvent:
    E = pb.ProcessEvent
    match event:
        case ops.ProcessStarted(pid=pid):
            return E(
                event=Oneof[Literal["start"], pb.ProcessEvent.StartEvent]("start", E.StartEvent(pid=pid))
            )
        case ops.ProcessOutput():
            return E(event=Oneof[Literal["data"], pb.ProcessEvent.DataEvent]("data", _output(event)))
        case ops.ProcessEnded():
            end = E.EndEvent(
                exit_code=event.exit_code, exited=event.exited, status=event.status, error=event.error
            )
            return E(event=Oneof[Literal["end"], pb.ProcessEvent.EndEvent]("end", end))
    raise AssertionError(f"not a process event: {event!r}")


def _keepalive() -> pb.ProcessEvent:
    E = pb.ProcessEvent
    return E(event=Oneof[Literal["keepalive"], pb.ProcessEvent.KeepAlive]("keepalive", E.KeepAlive()))


def _start_message(event: ops.ProcessEvent) -> pb.StartResponse:
    return pb.StartResponse(event=process_event(event))


def _start_keepalive() -> pb.StartResponse:
    return pb.StartResponse(event=_keepalive())


def _connect_message(event: ops.ProcessEvent) -> pb.ConnectResponse:
    return pb.ConnectResponse(event=process_event(event))


def _connect_keepalive() -> pb.ConnectResponse:
    return pb.ConnectResponse(event=_keepalive())


def _signal(value: Any) -> ops.Signal:
    if value == pb.Signal.SIGKILL:
        return "SIGKILL"
    if value == pb.Signal.SIGTERM:
        return "SIGTERM"
    raise _invalid("signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")


class ProcessService:
    """Implements the generated ``process_connect.Process`` protocol."""

    def __init__(self, processes: ops.ProcessOps) -> None:
        self.processes = processes

    async def start(
        self, request: pb.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.StartResponse]:
        who, spec = caller(ctx), process_spec(request)
        events = self.processes.start(who, spec)
        async for message in stream(ctx, events, _start_message, _start_keepalive):
            yield message

    async def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.ConnectResponse]:
        who, ref = caller(ctx), process_ref(request.process)
        events = self.processes.connect(who, ref)
        async for message in stream(ctx, events, _connect_message, _connect_keepalive):
            yield message

    async def list(self, request: pb.ListRequest, ctx: RequestContext[Any, Any]) -> pb.ListResponse:
        found: list[ops.ProcessInfo] = await unary(
            functools.partial(self.processes.list_processes, caller(ctx))
        )
        return pb.ListResponse(
            processes=[
                pb.ProcessInfo(
                    pid=p.pid,
                    tag=p.tag,
                    config=pb.ProcessConfig(cmd=p.cmd, args=list(p.args), envs=dict(p.envs), cwd=p.cwd),
                )
                for p in found
            ]
        )

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext[Any, Any]) -> pb.UpdateResponse:
        ref, size = process_ref(request.process), _pty_size(request.pty)
        if size is None:
            raise _invalid("nothing to update: give pty.size")
        await unary(lambda: self.processes.resize(caller(ctx), ref, size[0], size[1]))
        return pb.UpdateResponse()

    async def send_input(
        self, request: pb.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> pb.SendInputResponse:
        ref = process_ref(request.process)
        data, pty = _input(request.input)
        await unary(lambda: self.processes.send_input(caller(ctx), ref, data, pty))
        return pb.SendInputResponse()

    async def stream_input(
        self, request: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext[Any, Any]
    ) -> pb.StreamInputResponse:
        """The first message names the process, every data message is written in order."""
        who = caller(ctx)
        ref: ops.ProcessRef | None = None
        async for message in request:
            chosen = message.event
            if chosen is None or chosen.field == "keepalive":
                continue
            if chosen.field == "start":
                ref = process_ref(chosen.value.process)
                continue
            if ref is None:
                raise _invalid("StreamInput starts with a start event naming the process")
            data, pty = _input(chosen.value.input)
            await unary(functools.partial(self.processes.send_input, who, ref, data, pty))
        return pb.StreamInputResponse()

    async def send_signal(
        self, request: pb.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> pb.SendSignalResponse:
        ref, sig = process_ref(request.process), _signal(request.signal)
        await unary(lambda: self.processes.signal(caller(ctx), ref, sig))
        return pb.SendSignalResponse()

    async def close_stdin(
        self, request: pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> pb.CloseStdinResponse:
        ref = process_ref(request.process)
        await unary(lambda: self.processes.close_stdin(caller(ctx), ref))
        return pb.CloseStdinResponse()


def _input(given: pb.ProcessInput | None) -> tuple[bytes, bool]:
    chosen = given.input if given is not None else None
    if chosen is None:
        raise _invalid("input must hold stdin or pty bytes")
    return bytes(chosen.value), chosen.field == "pty"
