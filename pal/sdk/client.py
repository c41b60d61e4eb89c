"""Synchronous client: `Client().runtime.schedule()/exec()/pause()/...`."""

from __future__ import annotations

import builtins
from collections.abc import Generator, Iterator
from typing import Any, Unpack

import httpx

from . import _pages, _wire
from ._wire import ExecOptions
from .code import Code, CodeOptions, CodeResult
from .models import ExecEvent, ExecResult, FileBytes, FileText
from .processes import Processes
from .volumes import Volumes


class Client:
    """Talks to a Pal server. Defaults: ``PAL_URL`` (else http://127.0.0.1:8080) and
    ``PAL_API_KEY``. ``http_client`` replaces the underlying httpx.Client (tests)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = _wire.DEFAULT_TIMEOUT,
        *,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.base_url, self.api_key = _wire.resolve(base_url, api_key)
        self.timeout = timeout
        self._http = http_client or httpx.Client(base_url=self.base_url, timeout=timeout)
        self._http.headers.update(_wire.headers(self.api_key))
        self.runtime = Runtime(self)
        self.volumes = Volumes(self)  # create/list/get/delete/resize (docs/volumes.md)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise _wire.connection_error(exc, self.base_url) from exc
        return _wire.check(resp)

    def health(self) -> dict[str, Any]:
        return dict(self.request("GET", "/healthz").json())

    def images(self, *, page_size: int | None = None) -> list[dict[str, Any]]:
        """The images this tenant may schedule (name, digest, user, workdir, env, warmSizes...)."""
        return list(self.iter_images(page_size=page_size))

    def iter_images(self, *, page_size: int | None = None) -> Iterator[dict[str, Any]]:
        """:meth:`images` a page at a time (``page_size`` per request)."""
        fetch = lambda q: self.request("GET", "/v1/images", params=q).json()  # noqa: E731
        return _pages.iterate(fetch, "images", _pages.params(page_size))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Runtime(_wire.RuntimeCalls):
    """The /v1/runtime calls. VM-shaped answers are the server's camelCase JSON dicts."""

    def __init__(self, client: Client) -> None:
        super().__init__(client)
        self.processes = Processes(client)  # start/list/get/read/output/send_stdin/...
        self.code = Code(client)  # run/create_context/list_contexts/delete_context/interrupt

    def schedule(self, **spec: Any) -> dict[str, Any]:
        """``spec`` is an AgentSpec in camelCase or snake_case keys (image, limits, secrets,
        idleTimeoutSecs, boot...)."""
        return dict(self._json("POST", "/schedule", json=spec))

    def get(self, vm_id: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/vms/{_wire.seg(vm_id)}"))

    def list(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """The tenant's VMs (all pages); ``metadata``: only those carrying all these tags."""
        return list(self.iter_vms(metadata, page_size=page_size))

    def iter_vms(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """:meth:`list` a page at a time (``page_size`` VMs per request), lazily."""
        fetch = lambda q: self._json("GET", "/vms", params=q)  # noqa: E731
        return _pages.iterate(fetch, "vms", _pages.params(page_size, metadata))

    def set_lifetime(
        self,
        vm_id: str,
        lifetime_secs: int | None = None,
        *,
        extend_secs: int | None = None,
        on_lifetime_end: str | None = None,
    ) -> dict[str, Any]:
        """Set the VM's lifetime (``lifetime_secs`` from its schedule; 0: none) or extend it
        (``extend_secs`` past its current end); ``on_lifetime_end``: ``pause`` or ``delete``.
        Returns the VM."""
        body = _pages.lifetime_body(lifetime_secs, extend_secs, on_lifetime_end)
        return dict(self._json("PUT", f"/vms/{_wire.seg(vm_id)}/lifetime", json=body))

    def extend_lifetime(self, vm_id: str, secs: int) -> dict[str, Any]:
        """The VM's lifetime ends ``secs`` later. Returns the VM."""
        return self.set_lifetime(vm_id, extend_secs=secs)

    def delete(self, vm_id: str) -> dict[str, Any]:
        return dict(self._json("DELETE", f"/vms/{_wire.seg(vm_id)}"))

    def pause(self, vm_id: str, mode: str = "snapshot", *, offload: bool = False) -> dict[str, Any]:
        """``mode="snapshot"`` (default: snapshot and stop, frees the slot) or ``"live"``
        (vCPUs stopped in place, connections kept; ``offload`` also hands the RAM back).
        Resume continues either kind."""
        body = None if mode == "snapshot" and not offload else {"mode": mode, "offload": offload}
        return dict(self._json("POST", f"/vms/{_wire.seg(vm_id)}/pause", json=body))

    def resume(self, vm_id: str) -> dict[str, Any]:
        return dict(self._json("POST", f"/vms/{_wire.seg(vm_id)}/resume"))

    def run_code(self, vm_id: str, code: str, **opts: Unpack[CodeOptions]) -> CodeResult:
        """Run a cell in the VM's kernel (``language`` python or bash; ``context``: a context
        id, default the language's default context). Variables persist between cells."""
        return self.code.run(vm_id, code, **opts)

    def fork(
        self,
        vm_id: str,
        count: int = 1,
        *,
        metadata: dict[str, str] | None = None,
        secrets: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``count`` copy-on-write copies of a VM, as ``{sourceVmId, snapshotId, forks:
        [{vmId, state, error?}]}``. Each child is tagged ``metadata`` (a schedule's tags;
        ``{}``: none) instead of the source's, and has ``secrets`` (a schedule's) set over
        the source's."""
        body: dict[str, Any] = {"count": count} | _wire.given(metadata=metadata, secrets=secrets)
        return dict(self._json("POST", f"/vms/{_wire.seg(vm_id)}/fork", json=body))

    def exec(
        self, vm_id: str, command: str, argv: builtins.list[str] | None = None, **opts: Unpack[ExecOptions]
    ) -> ExecResult:
        body = _wire.exec_body(command, argv, **opts)
        timeout = _wire.exec_timeout(self._c.timeout)
        return _wire.exec_result(
            self._json("POST", f"/vms/{_wire.seg(vm_id)}/exec", json=body, timeout=timeout)
        )

    def exec_stream(
        self, vm_id: str, command: str, argv: builtins.list[str] | None = None, **opts: Unpack[ExecOptions]
    ) -> Generator[ExecEvent, None, None]:
        """Yield stdout/stderr events as the command produces them, then `exit` or `error`.
        ``close()`` (or leaving a ``with contextlib.closing(...)``) closes the connection early,
        which stops the command in the guest."""
        body = _wire.exec_body(command, argv, **opts)
        with self._sse("POST", f"/vms/{_wire.seg(vm_id)}/exec", json=body) as lines:
            parser = _wire.SseParser()
            for line in lines:
                yield from parser.feed([line])

    def list_files(self, vm_id: str, path: str = "") -> dict[str, Any]:
        return dict(self._json("GET", f"/vms/{_wire.seg(vm_id)}/files", params={"path": path}))

    def read_file(self, vm_id: str, path: str) -> FileText:
        """The file as text (UTF-8); ``UnicodeDecodeError`` if it is not text."""
        resp = self._c.request(
            "GET", f"/v1/runtime/vms/{_wire.seg(vm_id)}/files/content", params={"path": path}
        )
        return _wire.file_text(resp, path)

    def read_file_bytes(self, vm_id: str, path: str) -> FileBytes:
        """The file's bytes, exactly as stored (any content)."""
        resp = self._c.request(
            "GET", f"/v1/runtime/vms/{_wire.seg(vm_id)}/files/content", params={"path": path}
        )
        return _wire.file_bytes(resp)

    def write_file(self, vm_id: str, path: str, content: str | bytes) -> dict[str, Any]:
        """Create or replace a file (parents made as needed): ``str`` is written as UTF-8,
        ``bytes`` as they are. At most 1 MiB."""
        data = content.encode("utf-8") if isinstance(content, str) else content
        return dict(
            self._json(
                "PUT",
                f"/vms/{_wire.seg(vm_id)}/files/content",
                params={"path": path},
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
        )

    def delete_file(self, vm_id: str, path: str) -> dict[str, Any]:
        """Remove a file or symlink (not a directory)."""
        return dict(self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/files/content", params={"path": path}))

    def events(self, vm_id: str, *, page_size: int | None = None) -> builtins.list[dict[str, Any]]:
        return list(self.iter_events(vm_id, page_size=page_size))

    def iter_events(self, vm_id: str, *, page_size: int | None = None) -> Iterator[dict[str, Any]]:
        """The VM's status and audit events, oldest first, a page at a time."""
        fetch = lambda q: self._json("GET", f"/vms/{_wire.seg(vm_id)}/events", params=q)  # noqa: E731
        return _pages.iterate(fetch, "events", _pages.params(page_size))

    def metrics(self, vm_id: str) -> dict[str, Any]:
        """CPU %, host RSS/PSS, guest memory, disk and network samples of the last 15
        minutes (one every 5 s): ``{vmId, intervalSecs, live, samples: [{t, cpuPct, ...}]}``."""
        return dict(self._json("GET", f"/vms/{_wire.seg(vm_id)}/metrics"))

    def snapshots(self, vm_id: str, *, page_size: int | None = None) -> builtins.list[dict[str, Any]]:
        """The VM's snapshots kept on its node, with artifact sizes."""
        return list(self.iter_snapshots(vm_id, page_size=page_size))

    def iter_snapshots(self, vm_id: str, *, page_size: int | None = None) -> Iterator[dict[str, Any]]:
        fetch = lambda q: self._json("GET", f"/vms/{_wire.seg(vm_id)}/snapshots", params=q)  # noqa: E731
        return _pages.iterate(fetch, "snapshots", _pages.params(page_size))

    def keep_snapshot(self, vm_id: str, name: str | None = None) -> dict[str, Any]:
        """Keep a snapshot of the VM, by ``name`` if given (docs/lifecycle.md, "Kept
        snapshots"): out of its retention, past its delete; ``{snapshotId, name, sourceVmId,
        createdAt}``. The VM runs on (or stays paused)."""
        body = {} if name is None else {"name": name}
        return dict(self._json("POST", f"/vms/{_wire.seg(vm_id)}/snapshots", json=body))

    def kept_snapshots(
        self, *, vm_id: str | None = None, name: str | None = None, page_size: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """The tenant's kept snapshots, oldest first (of one VM, of one name or id)."""
        return list(self.iter_kept_snapshots(vm_id=vm_id, name=name, page_size=page_size))

    def iter_kept_snapshots(
        self, *, vm_id: str | None = None, name: str | None = None, page_size: int | None = None
    ) -> Iterator[dict[str, Any]]:
        query = _pages.params(page_size) | _wire.given(vmId=vm_id, name=name)
        fetch = lambda q: self._json("GET", "/snapshots", params=q)  # noqa: E731
        return _pages.iterate(fetch, "snapshots", query)

    def kept_snapshot(self, snapshot: str) -> dict[str, Any]:
        """A kept snapshot, by id or name."""
        return dict(self._json("GET", f"/snapshots/{_wire.seg(snapshot)}"))

    def delete_kept_snapshot(self, snapshot: str) -> dict[str, Any]:
        """Let a kept snapshot go (by id or name); the VMs started from it run on."""
        return dict(self._json("DELETE", f"/snapshots/{_wire.seg(snapshot)}"))

    def start_from_snapshot(
        self,
        snapshot: str,
        count: int = 1,
        *,
        metadata: dict[str, str] | None = None,
        secrets: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``count`` new VMs from a kept snapshot (its memory, disk and processes), as a
        fork answers: ``{sourceVmId, snapshotId, forks: [{vmId, state, error?}]}``. Each is
        tagged ``metadata`` (a schedule's tags; ``{}``: none) instead of the source's tags,
        with ``secrets`` (a schedule's) set over the source's."""
        body: dict[str, Any] = {"count": count} | _wire.given(metadata=metadata, secrets=secrets)
        return dict(self._json("POST", f"/snapshots/{_wire.seg(snapshot)}/start", json=body))

    def port_url(self, vm_id: str, port: int, expires_in_secs: int = 3600) -> dict[str, Any]:
        """A signed link that opens the server on ``port`` in the VM on the port's own origin
        (``{url, expiresAt, linkId}``), without the API key, until it expires or is revoked;
        bound to this VM and port."""
        body = {"expiresInSecs": expires_in_secs}
        return dict(self._json("POST", f"/vms/{_wire.seg(vm_id)}/ports/{_wire.seg(port)}/url", json=body))

    def revoke_port_url(self, vm_id: str, link_id: str) -> dict[str, Any]:
        """Revoke a link ``port_url`` made (its ``linkId``): it opens nothing from now on.
        ``pal tenants rotate-key`` ends all of the tenant's links at once."""
        return dict(self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/port-links/{_wire.seg(link_id)}"))

    def rotate_secret(self, vm_id: str, name: str, value: str) -> dict[str, Any]:
        """A brokered secret's new value; the VM's next request carries it (the guest, which
        holds only the placeholder, is not touched). ``{name, applied}``."""
        return dict(
            self._json("PUT", f"/vms/{_wire.seg(vm_id)}/secrets/{_wire.seg(name)}", json={"value": value})
        )

    def set_egress(self, vm_id: str, egress: str | dict[str, builtins.list[str]]) -> dict[str, Any]:
        """Change the egress policy (`"none"`, `"open"`, `{"allow": [...]}` or `{"deny": [...]}`);
        a running VM applies it to its next connection. Returns the VM."""
        return dict(self._json("PUT", f"/vms/{_wire.seg(vm_id)}/egress", json={"egress": egress}))
