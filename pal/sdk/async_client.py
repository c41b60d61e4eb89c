"""Asynchronous client: `await AsyncClient().runtime.schedule()`; mirrors client.py."""

from __future__ import annotations

import builtins
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Unpack

import httpx

from . import _pages, _wire
from ._wire import ExecOptions
from .code import AsyncCode, CodeOptions, CodeResult
from .models import ExecEvent, ExecResult, FileBytes, FileText
from .processes import AsyncProcesses
from .volumes import AsyncVolumes


class AsyncClient:
    """Talks to a Pal server. Defaults: ``PAL_URL`` (else http://127.0.0.1:8080) and
    ``PAL_API_KEY``. ``http_client`` replaces the underlying httpx.AsyncClient (tests)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = _wire.DEFAULT_TIMEOUT,
        *,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url, self.api_key = _wire.resolve(base_url, api_key)
        self.timeout = timeout
        self._http = http_client or httpx.AsyncClient(base_url=self.base_url, timeout=timeout)
        self._http.headers.update(_wire.headers(self.api_key))
        self.runtime = AsyncRuntime(self)
        self.volumes = AsyncVolumes(self)  # create/list/get/delete/resize (docs/volumes.md)

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise _wire.connection_error(exc, self.base_url) from exc
        return _wire.check(resp)

    async def health(self) -> dict[str, Any]:
        return dict((await self.request("GET", "/healthz")).json())

    async def images(self, *, page_size: int | None = None) -> list[dict[str, Any]]:
        """The images this tenant may schedule (name, digest, user, workdir, env, warmSizes...)."""
        return [i async for i in self.iter_images(page_size=page_size)]

    def iter_images(self, *, page_size: int | None = None) -> AsyncIterator[dict[str, Any]]:
        """:meth:`images` a page at a time (``async for``)."""

        async def fetch(q: dict[str, Any]) -> Any:
            return (await self.request("GET", "/v1/images", params=q)).json()

        return _pages.aiterate(fetch, "images", _pages.params(page_size))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


class AsyncRuntime(_wire.AsyncRuntimeCalls):
    """The /v1/runtime calls. VM-shaped answers are the server's camelCase JSON dicts."""

    def __init__(self, client: AsyncClient) -> None:
        super().__init__(client)
        self.processes = AsyncProcesses(client)  # start/list/get/read/output/send_stdin/...
        self.code = AsyncCode(client)  # run/create_context/list_contexts/delete_context/interrupt

    async def schedule(self, **spec: Any) -> dict[str, Any]:
        """``spec`` is an AgentSpec in camelCase or snake_case keys (image, limits, secrets,
        idleTimeoutSecs, boot...)."""
        return dict(await self._json("POST", "/schedule", json=spec))

    async def get(self, vm_id: str) -> dict[str, Any]:
        return dict(await self._json("GET", f"/vms/{_wire.seg(vm_id)}"))

    async def list(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """The tenant's VMs (all pages); ``metadata``: only those carrying all these tags."""
        return [vm async for vm in self.iter_vms(metadata, page_size=page_size)]

    def iter_vms(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """:meth:`list` a page at a time (``async for``)."""

        async def fetch(q: dict[str, Any]) -> Any:
            return await self._json("GET", "/vms", params=q)

        return _pages.aiterate(fetch, "vms", _pages.params(page_size, metadata))

    async def set_lifetime(
        self,
        vm_id: str,
        lifetime_secs: int | None = None,
        *,
        extend_secs: int | None = None,
        on_lifetime_end: str | None = None,
    ) -> dict[str, Any]:
        """See :meth:`pal.sdk.client.Runtime.set_lifetime`."""
        body = _pages.lifetime_body(lifetime_secs, extend_secs, on_lifetime_end)
        return dict(await self._json("PUT", f"/vms/{_wire.seg(vm_id)}/lifetime", json=body))

    async def extend_lifetime(self, vm_id: str, secs: int) -> dict[str, Any]:
        """The VM's lifetime ends ``secs`` later. Returns the VM."""
        return await self.set_lifetime(vm_id, extend_secs=secs)

    async def delete(self, vm_id: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", f"/vms/{_wire.seg(vm_id)}"))

    async def pause(self, vm_id: str, mode: str = "snapshot", *, offload: bool = False) -> dict[str, Any]:
        """``mode="snapshot"`` (default: snapshot and stop, frees the slot) or ``"live"``
        (vCPUs stopped in place, connections kept; ``offload`` also hands the RAM back).
        Resume continues either kind."""
        body = None if mode == "snapshot" and not offload else {"mode": mode, "offload": offload}
        return dict(await self._json("POST", f"/vms/{_wire.seg(vm_id)}/pause", json=body))

    async def resume(self, vm_id: str) -> dict[str, Any]:
        return dict(await self._json("POST", f"/vms/{_wire.seg(vm_id)}/resume"))

    async def run_code(self, vm_id: str, code: str, **opts: Unpack[CodeOptions]) -> CodeResult:
        """Run a cell in the VM's kernel (``language`` python or bash; ``context``: a context
        id, default the language's default context). Variables persist between cells."""
        return await self.code.run(vm_id, code, **opts)

    async def fork(
        self,
        vm_id: str,
        count: int = 1,
        *,
        metadata: dict[str, str] | None = None,
        secrets: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """See :meth:`pal.sdk.client.Runtime.fork`."""
        body: dict[str, Any] = {"count": count} | _wire.given(metadata=metadata, secrets=secrets)
        return dict(await self._json("POST", f"/vms/{_wire.seg(vm_id)}/fork", json=body))

    async def exec(
        self, vm_id: str, command: str, argv: builtins.list[str] | None = None, **opts: Unpack[ExecOptions]
    ) -> ExecResult:
        body = _wire.exec_body(command, argv, **opts)
        timeout = _wire.exec_timeout(self._c.timeout)
        return _wire.exec_result(
            await self._json("POST", f"/vms/{_wire.seg(vm_id)}/exec", json=body, timeout=timeout)
        )

    async def exec_stream(
        self, vm_id: str, command: str, argv: builtins.list[str] | None = None, **opts: Unpack[ExecOptions]
    ) -> AsyncGenerator[ExecEvent, None]:
        """Yield stdout/stderr events as the command produces them, then `exit` or `error`."""
        body = _wire.exec_body(command, argv, **opts)
        async with self._sse("POST", f"/vms/{_wire.seg(vm_id)}/exec", json=body) as lines:
            parser = _wire.SseParser()
            async for line in lines:
                for ev in parser.feed([line]):
                    yield ev

    async def list_files(self, vm_id: str, path: str = "") -> dict[str, Any]:
        return dict(await self._json("GET", f"/vms/{_wire.seg(vm_id)}/files", params={"path": path}))

    async def read_file(self, vm_id: str, path: str) -> FileText:
        """The file as text (UTF-8); ``UnicodeDecodeError`` if it is not text."""
        resp = await self._c.request(
            "GET", f"/v1/runtime/vms/{_wire.seg(vm_id)}/files/content", params={"path": path}
        )
        return _wire.file_text(resp, path)

    async def read_file_bytes(self, vm_id: str, path: str) -> FileBytes:
        """The file's bytes, exactly as stored (any content)."""
        resp = await self._c.request(
            "GET", f"/v1/runtime/vms/{_wire.seg(vm_id)}/files/content", params={"path": path}
        )
        return _wire.file_bytes(resp)

    async def write_file(self, vm_id: str, path: str, content: str | bytes) -> dict[str, Any]:
        """Create or replace a file (parents made as needed): ``str`` is written as UTF-8,
        ``bytes`` as they are. At most 1 MiB."""
        data = content.encode("utf-8") if isinstance(content, str) else content
        return dict(
            await self._json(
                "PUT",
                f"/vms/{_wire.seg(vm_id)}/files/content",
                params={"path": path},
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
        )

    async def delete_file(self, vm_id: str, path: str) -> dict[str, Any]:
        """Remove a file or symlink (not a directory)."""
        return dict(
            await self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/files/content", params={"path": path})
        )

    async def events(self, vm_id: str, *, page_size: int | None = None) -> builtins.list[dict[str, Any]]:
        return [e async for e in self.iter_events(vm_id, page_size=page_size)]

    def iter_events(self, vm_id: str, *, page_size: int | None = None) -> AsyncIterator[dict[str, Any]]:
        async def fetch(q: dict[str, Any]) -> Any:
            return await self._json("GET", f"/vms/{_wire.seg(vm_id)}/events", params=q)

        return _pages.aiterate(fetch, "events", _pages.params(page_size))

    async def metrics(self, vm_id: str) -> dict[str, Any]:
        """See :meth:`pal.sdk.client.Runtime.metrics`."""
        return dict(await self._json("GET", f"/vms/{_wire.seg(vm_id)}/metrics"))

    async def snapshots(self, vm_id: str, *, page_size: int | None = None) -> builtins.list[dict[str, Any]]:
        return [x async for x in self.iter_snapshots(vm_id, page_size=page_size)]

    def iter_snapshots(self, vm_id: str, *, page_size: int | None = None) -> AsyncIterator[dict[str, Any]]:
        async def fetch(q: dict[str, Any]) -> Any:
            return await self._json("GET", f"/vms/{_wire.seg(vm_id)}/snapshots", params=q)

        return _pages.aiterate(fetch, "snapshots", _pages.params(page_size))

    async def keep_snapshot(self, vm_id: str, name: str | None = None) -> dict[str, Any]:
        body = {} if name is None else {"name": name}
        return dict(await self._json("POST", f"/vms/{_wire.seg(vm_id)}/snapshots", json=body))

    async def kept_snapshots(
        self, *, vm_id: str | None = None, name: str | None = None, page_size: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        return [x async for x in self.iter_kept_snapshots(vm_id=vm_id, name=name, page_size=page_size)]

    def iter_kept_snapshots(
        self, *, vm_id: str | None = None, name: str | None = None, page_size: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async def fetch(q: dict[str, Any]) -> Any:
            return await self._json("GET", "/snapshots", params=q)

        query = _pages.params(page_size) | _wire.given(vmId=vm_id, name=name)
        return _pages.aiterate(fetch, "snapshots", query)

    async def kept_snapshot(self, snapshot: str) -> dict[str, Any]:
        return dict(await self._json("GET", f"/snapshots/{_wire.seg(snapshot)}"))

    async def delete_kept_snapshot(self, snapshot: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", f"/snapshots/{_wire.seg(snapshot)}"))

    async def start_from_snapshot(
        self,
        snapshot: str,
        count: int = 1,
        *,
        metadata: dict[str, str] | None = None,
        secrets: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """See :meth:`pal.sdk.client.Runtime.start_from_snapshot`."""
        body: dict[str, Any] = {"count": count} | _wire.given(metadata=metadata, secrets=secrets)
        return dict(await self._json("POST", f"/snapshots/{_wire.seg(snapshot)}/start", json=body))

    async def port_url(self, vm_id: str, port: int, expires_in_secs: int = 3600) -> dict[str, Any]:
        """See :meth:`pal.sdk.client.Runtime.port_url`."""
        body = {"expiresInSecs": expires_in_secs}
        return dict(
            await self._json("POST", f"/vms/{_wire.seg(vm_id)}/ports/{_wire.seg(port)}/url", json=body)
        )

    async def revoke_port_url(self, vm_id: str, link_id: str) -> dict[str, Any]:
        """See :meth:`pal.sdk.client.Runtime.revoke_port_url`."""
        return dict(await self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/port-links/{_wire.seg(link_id)}"))

    async def rotate_secret(self, vm_id: str, name: str, value: str) -> dict[str, Any]:
        """A brokered secret's new value; the VM's next request carries it (the guest, which
        holds only the placeholder, is not touched). ``{name, applied}``."""
        return dict(
            await self._json(
                "PUT", f"/vms/{_wire.seg(vm_id)}/secrets/{_wire.seg(name)}", json={"value": value}
            )
        )

    async def set_egress(self, vm_id: str, egress: str | dict[str, builtins.list[str]]) -> dict[str, Any]:
        """Change the egress policy (`"none"`, `"open"`, `{"allow": [...]}` or `{"deny": [...]}`);
        a running VM applies it to its next connection. Returns the VM."""
        return dict(await self._json("PUT", f"/vms/{_wire.seg(vm_id)}/egress", json={"egress": egress}))
