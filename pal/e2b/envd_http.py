"""envd's HTTP API (E2B's published envd.yaml) over :class:`ops.FilesystemOps` and
:class:`ops.AgentInfoOps`: ``/files`` (download; upload as multipart with one or several
files, or as one octet-stream body, gzip allowed), ``/health``, ``/envs``, ``/metrics``.

Uploads are bounded before they are read (``Content-Length``) and while they are read
(a chunked or gzip body counted as it comes, decompressed bytes included), so a huge or
inflating body is refused with 413 without being buffered. An upload refused on its
headers (metadata, media type, path, signature) has its body read and dropped when it is
small (``DISCARD_BYTES``): a server that answers and closes with bytes unread resets the
connection, and the client then sees a transport error instead of the answer.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive

from pal.errors import InvalidRequest, PalError, TooLarge, Unauthorized
from pal.guest.xattrs import check_metadata

from . import ops
from .access import check_signature, check_user
from .errors import json_error, message_of
from .streams import Target, current_target

CHUNK = 256 * 1024
GZIP_SAMPLE = 16 * 1024  # the first bytes of a download that decide whether gzip pays
GZIP_WORTH = 0.9  # gzip pays when the sample shrinks to this share of its size or less
MAX_FILES_PER_UPLOAD = 1000
METADATA_PREFIX = "x-metadata-"
DISCARD_BYTES = 4 * 1024 * 1024  # of a body refused on its headers, read and dropped


@dataclass(frozen=True)
class FilesConfig:
    max_upload_bytes: int = 64 * 1024 * 1024


async def _on_pal_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PalError)
    return json_error(exc.status, message_of(exc))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path} is not served by the sandbox agent"
    return json_error(exc.status_code, message)


def metadata_from_headers(headers: Any) -> dict[str, str]:
    """``X-Metadata-<key>: <value>`` request headers as the files' metadata (the key
    lowercased, the first of repeated headers); 400 beyond envd's bounds (xattrs.py's
    check, the guest's own), before the body is read."""
    out: dict[str, str] = {}
    for raw_key, raw_value in headers.raw:
        name = raw_key.decode("latin-1").lower()
        if name.startswith(METADATA_PREFIX):
            out.setdefault(name[len(METADATA_PREFIX) :], raw_value.decode("latin-1"))
    why = check_metadata(out)
    if why is not None:
        raise InvalidRequest(why)
    return out


def _caller(request: Request, target: Target, path: str, operation: str) -> ops.Caller:
    """The caller of a ``/files`` request: its user (``username=``), authorised by the
    sandbox's access token (checked by the agent app) or this URL's signature."""
    user = check_user(request.query_params.get("username"))
    if not target.authorised:
        given = request.query_params.get("signature")
        if not given or target.access_token is None:
            raise Unauthorized("this sandbox is secure: send X-Access-Token or a signed URL")
        check_signature(
            given,
            request.query_params.get("signature_expiration"),
            path=path,
            operation="read" if operation == "read" else "write",
            user=user,
            token=target.access_token,
        )
    return ops.Caller(tenant=target.tenant, sandbox_id=target.sandbox_id, user=user)


class _Budget:
    """Counts an upload's bytes (after decompression) against its bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise TooLarge(f"upload larger than {self.limit} bytes")


def _bounded_receive(receive: Receive, budget: _Budget) -> Receive:
    async def counted() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            budget.take(len(message.get("body", b"")))
        return message

    return counted


def _check_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise TooLarge(f"upload of {length} bytes: at most {limit}")


async def _gunzipped(chunks: AsyncIterator[bytes], budget: _Budget) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in chunks:
            data = chunk
            while data:
                out = inflate.decompress(data, CHUNK)
                budget.take(len(out))
                if out:
                    yield out
                data = inflate.unconsumed_tail
        tail = inflate.flush()
    except zlib.error as exc:
        raise InvalidRequest(f"the body is not valid gzip: {exc}") from None
    budget.take(len(tail))
    if tail:
        yield tail
    if not inflate.eof:
        raise InvalidRequest("the gzip body ends before its end")


async def _upload_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(CHUNK):
        yield chunk


def accepts_gzip(accept_encoding: str) -> bool:
    """Does the request's ``Accept-Encoding`` take gzip (by name or ``*``, not at q=0)?"""
    for item in accept_encoding.lower().split(","):
        name, _, params = item.partition(";")
        if name.strip() in ("gzip", "x-gzip", "*"):
            q = params.strip().removeprefix("q=")
            try:
                return not params.strip() or float(q) > 0
            except ValueError:
                return True
    return False


def _pays(sample: bytes) -> bool:
    """Would gzip shrink data like ``sample``? Data that is already compressed or random
    (an archive, an image, this row of the benchmark) costs ~100 ms of CPU per MiB to
    gzip for nothing, on both ends: it is sent as it is, which every client takes."""
    return len(zlib.compress(sample, 1)) <= GZIP_WORTH * len(sample)


async def _gzipped(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    deflate = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    if out := deflate.compress(first):
        yield out
    async for chunk in chunks:
        if out := deflate.compress(chunk):
            yield out
    yield deflate.flush()


async def _then(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in chunks:
        yield chunk


async def encoded(
    chunks: AsyncIterator[bytes], accept_encoding: str
) -> tuple[dict[str, str], AsyncIterator[bytes]]:
    """A download's body and its ``Content-Encoding``: gzip when the client takes it and
    the file's first bytes say it pays; else the bytes as they are."""
    if not accepts_gzip(accept_encoding):
        return {}, chunks
    first = await anext(chunks, b"")
    if first and _pays(first[:GZIP_SAMPLE]):
        return {"Content-Encoding": "gzip"}, _gzipped(first, chunks)
    return {}, _then(first, chunks)


def _written(entry: ops.Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"path": entry.path, "name": entry.name, "type": "file"}
    if entry.metadata:
        out["metadata"] = dict(entry.metadata)
    return out


def create_envd_http_app(files: ops.FilesystemOps, info: ops.AgentInfoOps, config: FilesConfig) -> Starlette:
    return Starlette(
        routes=[*_info_routes(info), *_file_routes(files, config)],
        exception_handlers={PalError: _on_pal_error, HTTPException: _on_http_error},
    )


def _info_routes(info: ops.AgentInfoOps) -> list[Route]:
    """``/health``, ``/envs``, ``/metrics``: the agent and its sandbox."""

    async def health(_request: Request) -> Response:
        return Response(status_code=204)

    async def envs(_request: Request) -> Response:
        target = current_target.get()
        return JSONResponse(await info.envs(ops.Caller(target.tenant, target.sandbox_id)))

    async def metrics(_request: Request) -> Response:
        target = current_target.get()
        m = await info.metrics(ops.Caller(target.tenant, target.sandbox_id))
        mib = 1024 * 1024
        return JSONResponse(
            {
                "ts": m.ts,
                "cpu_count": m.cpu_count,
                "cpu_used_pct": m.cpu_used_pct,
                "mem_total": m.mem_total,
                "mem_used": m.mem_used,
                "mem_cache": m.mem_cache,
                "mem_total_mib": m.mem_total // mib,
                "mem_used_mib": m.mem_used // mib,
                "disk_used": m.disk_used,
                "disk_total": m.disk_total,
            }
        )

    return [
        Route("/health", health, methods=["GET"]),
        Route("/envs", envs, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _file_routes(files: ops.FilesystemOps, config: FilesConfig) -> list[Route]:
    """``/files``: download one file; upload one or several."""

    async def download(request: Request) -> Response:
        path = request.query_params.get("path") or ""
        if not path:
            raise InvalidRequest("path is required")
        who = _caller(request, current_target.get(), path, "read")
        encoding, chunks = await encoded(
            await files.read(who, path), request.headers.get("accept-encoding", "")
        )
        return StreamingResponse(chunks, headers={"Content-Type": "application/octet-stream", **encoding})

    async def upload(request: Request) -> Response:
        query_path = request.query_params.get("path") or None
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        target = current_target.get()
        _check_length(request, config.max_upload_bytes)
        budget = _Budget(config.max_upload_bytes)
        encoding = request.headers.get("content-encoding", "identity").lower()
        try:  # what the headers alone refuse, before any of the body is read
            metadata = metadata_from_headers(request.headers)
            if media not in ("multipart/form-data", "application/octet-stream", ""):
                raise InvalidRequest(
                    f"upload as multipart/form-data or application/octet-stream, not {media!r}"
                )
            if media != "multipart/form-data":
                if query_path is None:
                    raise InvalidRequest("an application/octet-stream upload needs path=")
                if encoding not in ("identity", "", "gzip"):
                    raise InvalidRequest(f"Content-Encoding {encoding!r}: identity or gzip")
                who = _caller(request, target, query_path, "write")
        except PalError:
            await _discard(request)
            raise
        if media == "multipart/form-data":
            counted = Request(request.scope, _bounded_receive(request.receive, budget))
            written = await _multipart(files, counted, target, query_path, metadata)
        else:
            assert query_path is not None
            body: AsyncIterator[bytes] = _counted_stream(request, budget)
            if encoding == "gzip":
                # Both the sent and the inflated bytes are bounded (a small body can inflate).
                body = _gunzipped(body, _Budget(config.max_upload_bytes))
            written = [await files.write(who, query_path, body, metadata)]
        return JSONResponse([_written(e) for e in written])

    return [Route("/files", download, methods=["GET"]), Route("/files", upload, methods=["POST"])]


async def _multipart(
    files: ops.FilesystemOps,
    request: Request,
    target: Target,
    query_path: str | None,
    metadata: Mapping[str, str],
) -> list[ops.Entry]:
    form = await request.form(max_files=MAX_FILES_PER_UPLOAD, max_fields=MAX_FILES_PER_UPLOAD)
    try:
        parts = [part for _, part in form.multi_items() if isinstance(part, UploadFile)]
        if not parts:
            raise InvalidRequest("the multipart body has no file part")
        written = []
        for part in parts:
            path = query_path if query_path is not None and len(parts) == 1 else part.filename
            if not path:
                raise InvalidRequest("each file part needs its path as its filename (or path=)")
            who = _caller(request, target, path, "write")
            written.append(await files.write(who, path, _upload_chunks(part), metadata))
        return written
    finally:
        await form.close()


async def _discard(request: Request) -> None:
    """Read and drop the unread body of a request refused on its headers, when it is at
    most ``DISCARD_BYTES`` (a larger one is cut: its client may see the reset)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > DISCARD_BYTES:
        return
    seen = 0
    with contextlib.suppress(Exception):  # a client gone meanwhile: nothing to answer
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DISCARD_BYTES:
                return


async def _counted_stream(request: Request, budget: _Budget) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        budget.take(len(chunk))
        if chunk:
            yield chunk
