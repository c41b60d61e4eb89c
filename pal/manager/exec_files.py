"""Exec and files: the manager's calls into a running guest over its harness channel.

This is the room for everything that proxies a request to the guest's harness: exec
streams and file requests today; the processes API (background processes with journals,
stdin, signals, PTYs: issue 22) and code kernels (issue 26) belong here too, next to
``exec_stream``. What every such call shares, and keeps:

- the VM must be running (``VmRegistry.running``: 409, or 409 LIVE_PAUSED when a live
  pause stopped its vCPUs, which the scheduler turns into a wake);
- the request enters the guest's channel under the VM's ``op_lock``, so a live pause comes
  either before it (and it answers LIVE_PAUSED) or after it (and its probe sees it);
- it counts as host-observed activity (``LiveVm.touch``; idle suspend goes by it);
- whatever the guest answers is hostile: decoded and bounded by guest_input.py, its error
  codes mapped to statuses by guest_errors.py (the one mapping).

The lock, the in-flight counts and the activity are ``LiveVm.exec_in_flight`` (a stream)
and ``LiveVm.request_in_flight`` (one request) in vm.py: a new call goes through one.
"""

from __future__ import annotations

import codecs
import logging
import time
from collections.abc import AsyncIterator

from pal.errors import PalError, Unavailable
from pal.guest import protocol as p
from pal.guest.xattrs import parse_metadata
from pal.manager import guest_input as gi
from pal.manager.channel import GuestError
from pal.manager.vm import LiveVm, VmRegistry
from pal.spec import ExecRequest
from pal.wire.guest_errors import to_pal_error
from pal.wire.models import ExecEvent, FileDeleted, FileList, FileWritten

log = logging.getLogger(__name__)


class GuestCalls:
    def __init__(self, registry: VmRegistry) -> None:
        self.registry = registry

    # ------------------------------------------------------------------ exec
    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        lv = self.registry.running(vm_id)
        msg: p.Message = {
            "k": p.K_EXEC,
            "tok": lv.token,
            "argv": [req.command, *req.argv],
            "env": req.env,
            "cwd": req.cwd,
            "timeout": req.timeout_secs,
            "user": req.user,
        }
        # A stream closed early kills its command, unless asked to leave it running.
        abandon = p.K_DETACH if req.detach_on_close else p.K_CANCEL
        async with lv.exec_in_flight(msg, abandon=abandon) as replies:
            async for ev in _exec_events(lv, replies):
                yield ev

    # ------------------------------------------------------------------ files
    async def _file_request(
        self, vm_id: str, msg: p.Message, data: bytes | None = None
    ) -> tuple[p.Message, bytes]:
        try:
            return await self.registry.running(vm_id).request_in_flight(msg, data)
        except GuestError as exc:
            raise to_pal_error(exc.guest_code, exc.message, "file") from None

    async def list_files(self, vm_id: str, path: str) -> FileList:
        reply, _ = await self._file_request(vm_id, {"k": p.K_LS, "path": path})
        try:
            return FileList.model_validate(gi.file_list(reply))
        except gi.BadReply as exc:
            raise _bad_reply(vm_id, "ls", exc) from None

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        reply, data = await self._file_request(
            vm_id, {"k": p.K_READ, "path": path, "limit": p.MAX_FILE_BYTES}
        )
        try:
            return gi.file_read(reply, data)
        except gi.BadReply as exc:
            raise _bad_reply(vm_id, "read", exc) from None

    async def write_file(
        self, vm_id: str, path: str, data: bytes, metadata: str | None = None
    ) -> FileWritten:
        msg: p.Message = {"k": p.K_WRITE, "path": path}
        if metadata is not None:  # checked by the request's model
            msg["meta"] = parse_metadata(metadata)
        reply, _ = await self._file_request(vm_id, msg, data)
        try:
            return FileWritten.model_validate(gi.file_written(reply, len(data)))
        except gi.BadReply as exc:
            raise _bad_reply(vm_id, "write", exc) from None

    async def delete_file(self, vm_id: str, path: str) -> FileDeleted:
        reply, _ = await self._file_request(vm_id, {"k": p.K_RM, "path": path})
        return FileDeleted.model_validate(reply["result"])


async def _exec_events(lv: LiveVm, replies: AsyncIterator[p.Message]) -> AsyncIterator[ExecEvent]:
    """The guest's exec replies as events: output decoded as UTF-8 per stream (a
    character split across two replies is kept whole), its exit, or its error code (no
    status: guest_errors.py maps it where the API answers)."""
    decoders = {
        1: codecs.getincrementaldecoder("utf-8")("replace"),
        2: codecs.getincrementaldecoder("utf-8")("replace"),
    }
    async for reply in replies:
        kind = reply["k"]
        if kind == p.K_STARTED:
            pid = gi.integer(reply.get("pid"), 1, gi.MAX_JSON_INT)
            if pid is not None:
                yield ExecEvent(type="process", process_id=pid)
        elif kind == p.K_OUT:
            lv.last_output_mono = time.monotonic()  # an exec producing output: not waiting
            fd = gi.out_fd(reply)
            data = gi.payload(reply)
            if data is None:
                continue  # not base64: noise from a misbehaving guest
            text = decoders[fd].decode(data)
            if text:
                yield ExecEvent(type="stdout" if fd == 1 else "stderr", data=text)
        elif kind == p.K_EXIT:
            for fd, dec in decoders.items():
                rest = dec.decode(b"", final=True)
                if rest:
                    yield ExecEvent(type="stdout" if fd == 1 else "stderr", data=rest)
            yield ExecEvent(type="exit", exit_code=gi.exit_code(reply))
        elif kind == p.K_ERR:
            code, message = gi.error(reply)
            yield ExecEvent(type="error", code=code, message=message)
        elif kind == p.K_OK:  # detached (channel.py: a slow reader); the process runs on
            res = reply.get("result")
            why = res.get("reason") if isinstance(res, dict) else None
            yield ExecEvent(type="detached", reason=gi.text(why, 32) if why else "detached")


def _bad_reply(vm_id: str, kind: str, exc: gi.BadReply) -> PalError:
    log.warning("VM %s: invalid %s reply from the guest: %s", vm_id, kind, exc)
    return Unavailable(f"VM {vm_id}: the guest sent an invalid reply to {kind}", code="GUEST_ERROR")
