"""A process's output as the API gives it (docs/processes.md): text that never cuts a
character, byte offsets that say exactly where a reader stands, and SSE whose event ids are
those offsets.

Text: the journal holds bytes, and a chunk may end inside a UTF-8 character. Such a tail
waits for the next chunk of the same stream; every offset handed out (an SSE ``id``, a
read's ``next``) is the one after the last byte given, so a reader resuming there neither
skips nor repeats a byte. Bytes that are not UTF-8 become U+FFFD; ``encoding=base64``
gives the bytes exactly.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi.responses import StreamingResponse

from pal.wire.processes import ProcessEvent, ProcessOutput

from .errors import public_error
from .exec_stream import FIRST_EVENT_GRACE_S, pumped_sse, sse_frame
from .json_response import JSONResponse
from .process_models import ProcessInfo

Encoding = Literal["text", "base64"]
Piece = tuple[str, str, int]  # (stream, data, offset after it)


def incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character that is not complete."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: a lead byte (or ASCII)
            need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            return back if need > back else 0
    return 0


class TextOutput:
    """Output chunks to text pieces; see the module's doc."""

    def __init__(self, encoding: Encoding = "text") -> None:
        self.encoding = encoding
        self.pending: tuple[str, int, bytes] | None = None  # stream, offset of its first byte, bytes

    @property
    def offset(self) -> int | None:
        """Where a reader stands when the pending bytes are not given: their first byte."""
        return self.pending[1] if self.pending else None

    def feed(self, stream: str, end: int, data: bytes) -> list[Piece]:
        if self.encoding == "base64":
            return [(stream, base64.b64encode(data).decode("ascii"), end)] if data else []
        out: list[Piece] = []
        start = end - len(data)
        if self.pending is not None:
            p_stream, p_off, p_data = self.pending
            self.pending = None
            if p_stream == stream and p_off + len(p_data) == start:
                data, start = p_data + data, p_off
            else:
                out.append((p_stream, p_data.decode("utf-8", "replace"), p_off + len(p_data)))
        keep = incomplete_tail(data)
        if keep:
            self.pending = (stream, start + len(data) - keep, data[-keep:])
            data = data[:-keep]
        if data:
            out.append((stream, data.decode("utf-8", "replace"), start + len(data)))
        return out

    def flush(self) -> list[Piece]:
        """The pending bytes as they are (the output is complete: nothing will finish them)."""
        if self.pending is None:
            return []
        stream, off, data = self.pending
        self.pending = None
        return [(stream, data.decode("utf-8", "replace"), off + len(data))]


def merged(pieces: list[Piece]) -> list[dict[str, str]]:
    """Adjacent text pieces of one stream as one ``{stream, data}`` item."""
    out: list[dict[str, str]] = []
    for stream, data, _end in pieces:
        if out and out[-1]["stream"] == stream:
            out[-1]["data"] += data
        else:
            out.append({"stream": stream, "data": data})
    return out


def read_view(res: ProcessOutput, encoding: Encoding) -> dict[str, Any]:
    """The JSON answer of a non-streaming read: ``{from, next, gap, output, process}``
    (``encoding`` too when it is base64)."""
    proc = res.process
    if encoding == "base64":  # adjacent chunks of a stream joined as bytes, then encoded
        raw: list[tuple[str, bytes]] = []
        for chunk in res.chunks:
            data = base64.b64decode(chunk.data)
            if raw and raw[-1][0] == chunk.stream:
                raw[-1] = (chunk.stream, raw[-1][1] + data)
            else:
                raw.append((chunk.stream, data))
        output = [{"stream": st, "data": base64.b64encode(d).decode("ascii")} for st, d in raw]
        raw_body = {
            "from": res.from_,
            "next": res.next,
            "gap": res.gap,
            "output": output,
            "encoding": "base64",
        }
        return {**raw_body, "process": ProcessInfo.of(proc).model_dump(by_alias=True, mode="json")}
    text = TextOutput(encoding)
    pieces: list[Piece] = []
    for chunk in res.chunks:
        data = base64.b64decode(chunk.data)
        pieces += text.feed(chunk.stream, chunk.offset + len(data), data)
    complete = not proc.running and res.next >= proc.journal.end
    if complete:
        pieces += text.flush()
    nxt = text.offset if text.offset is not None else res.next
    body: dict[str, Any] = {
        "from": res.from_,
        "next": nxt,
        "gap": res.gap,
        "output": merged(pieces),
        "process": ProcessInfo.of(proc).model_dump(by_alias=True, mode="json"),
    }
    return body


def _id_frame(event: str, offset: int, data: dict[str, Any]) -> bytes:
    return f"id: {offset}\n".encode() + sse_frame(event, data)


class _Frames:
    """Process events to SSE frames (one reader's text state)."""

    def __init__(self, encoding: Encoding) -> None:
        self.text = TextOutput(encoding)
        self.extra = {"encoding": "base64"} if encoding == "base64" else {}

    def pieces(self, pieces: list[Piece]) -> bytes:
        return b"".join(_id_frame(s, end, {"data": d, **self.extra}) for s, d, end in pieces)

    def frame(self, ev: ProcessEvent) -> bytes:
        if ev.type == "output":
            data = base64.b64decode(ev.data or "")
            return self.pieces(self.text.feed(ev.stream or "stdout", ev.offset or 0, data))
        if ev.type == "gap":
            return self.pieces(self.text.flush()) + _id_frame("gap", ev.offset or 0, {"lost": ev.lost})
        if ev.type == "exit":
            done = {"exitCode": ev.exit_code, "timedOut": bool(ev.timed_out)}
            return self.pieces(self.text.flush()) + sse_frame("exit", done)
        if ev.type == "detached":
            # Pending bytes are not given: the last id is before them, a reattach gets them.
            return sse_frame("detached", {"reason": ev.reason or "detached"})
        return sse_frame("error", public_error(ev.status or 503, ev.code or "GUEST_ERROR", ev.message or ""))


async def sse_output(
    open_events: Callable[[], AsyncIterator[ProcessEvent]],
    encoding: Encoding,
    grace_s: float = FIRST_EVENT_GRACE_S,
) -> StreamingResponse | JSONResponse:
    """The output stream as SSE; an error before the first event (404, 409, 400) keeps its
    status, one after it is an ``error`` event. One pump task drives the scheduler's
    iterator (exec_stream.py's reasons); when the client goes away it is cancelled, which
    detaches the reader in the guest (the process runs on)."""
    return await pumped_sse(
        open_events,
        "output stream",
        frame=_Frames(encoding).frame,
        ends=lambda ev: ev.type in ("exit", "detached", "error"),
        done_frame=sse_frame("detached", {"reason": "stream-ended"}),  # never a made-up exit
        grace_s=grace_s,
    )
