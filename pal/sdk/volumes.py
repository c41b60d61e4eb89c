"""``client.volumes``: volumes, storage that outlives a VM (docs/volumes.md). A volume is
named by its id or its name; answers are the server's camelCase JSON dicts
(``{volumeId, name, sizeMib, state, metadata, createdAt, updatedAt}``)."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Iterator
from typing import Any

from . import _pages, _wire
from .errors import NotFoundError
from .models import FileBytes, FileText

_RAW = {"Content-Type": "application/octet-stream"}


def _list_q(path: str, depth: int | None) -> dict[str, Any]:
    return {"path": path, **({"depth": depth} if depth is not None else {})}


def _flag(name: str, on: bool) -> dict[str, Any]:
    return {name: "true"} if on else {}


def _bytes(content: str | bytes) -> bytes:
    return content.encode("utf-8") if isinstance(content, str) else content


def _create_body(name: str, size_mib: int | None, metadata: dict[str, str] | None) -> dict[str, Any]:
    return _wire.given(name=name, sizeMib=size_mib, metadata=metadata)


def _force(force: bool) -> dict[str, Any]:
    return {"force": "true"} if force else {}


class Volumes:
    def __init__(self, client: Any) -> None:  # a Client
        self._c = client

    def create(
        self, name: str, size_mib: int | None = None, metadata: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """A new volume (``size_mib``: its limit, 1 GiB unless given; nothing is allocated
        until written). 409 for a name the tenant has; 402 past its volume quota."""
        return dict(
            self._c.request("POST", "/v1/volumes", json=_create_body(name, size_mib, metadata)).json()
        )

    def list(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """The tenant's volumes, oldest first (all pages); ``metadata``: only those with all
        these tags."""
        return list(self.iter(metadata, page_size=page_size))

    def iter(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> Iterator[dict[str, Any]]:
        fetch = lambda q: self._c.request("GET", "/v1/volumes", params=q).json()  # noqa: E731
        return _pages.iterate(fetch, "volumes", _pages.params(page_size, metadata))

    def get(self, volume: str) -> dict[str, Any]:
        """The volume (by id or name), with ``mountedBy``: the VMs that mount it."""
        return dict(self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}").json())

    def delete(self, volume: str, *, force: bool = False) -> dict[str, Any]:
        """Delete it and its files; refused (409) while VMs mount it, unless ``force``."""
        return dict(
            self._c.request("DELETE", f"/v1/volumes/{_wire.seg(volume)}", params=_force(force)).json()
        )

    def resize(self, volume: str, size_mib: int) -> dict[str, Any]:
        """Grow it to ``size_mib`` (a smaller size is a 400)."""
        body = {"sizeMib": size_mib}
        return dict(self._c.request("POST", f"/v1/volumes/{_wire.seg(volume)}/resize", json=body).json())

    # -- its files, without a sandbox (the shapes of a VM's files API) ------------------

    def list_files(self, volume: str, path: str = "", *, depth: int | None = None) -> dict[str, Any]:
        """``{path, entries: [{name, type, size, path, mode, uid, gid, modifiedAt, target?}],
        truncated}``: a directory of the volume, ``depth`` levels down (1 unless given)."""
        return dict(
            self._c.request(
                "GET", f"/v1/volumes/{_wire.seg(volume)}/files", params=_list_q(path, depth)
            ).json()
        )

    def stat(self, volume: str, path: str) -> dict[str, Any]:
        """One entry (a symlink is not followed); NotFoundError (FILE_NOT_FOUND) for none."""
        q = {"path": path}
        return dict(self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}/files/stat", params=q).json())

    def exists(self, volume: str, path: str) -> bool:
        try:
            self.stat(volume, path)
        except NotFoundError as exc:
            if exc.code == "FILE_NOT_FOUND":
                return False
            raise
        return True

    def read_file(self, volume: str, path: str) -> FileText:
        """The file as text (UTF-8); ``UnicodeDecodeError`` if it is not text."""
        resp = self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}/files/content", params={"path": path})
        return _wire.file_text(resp, path)

    def read_file_bytes(self, volume: str, path: str) -> FileBytes:
        resp = self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}/files/content", params={"path": path})
        return _wire.file_bytes(resp)

    def write_file(self, volume: str, path: str, content: str | bytes) -> dict[str, Any]:
        """Create or replace a file (parents made), the workload user's. At most 1 MiB."""
        resp = self._c.request(
            "PUT", f"/v1/volumes/{_wire.seg(volume)}/files/content", params={"path": path},
            content=_bytes(content), headers=_RAW,
        )  # fmt: skip
        return dict(resp.json())

    def make_dir(self, volume: str, path: str, *, parents: bool = False) -> dict[str, Any]:
        """``{path, created}``; ``parents``: mkdir -p."""
        q = {"path": path, **_flag("parents", parents)}
        return dict(self._c.request("POST", f"/v1/volumes/{_wire.seg(volume)}/files/dir", params=q).json())

    def delete_file(self, volume: str, path: str, *, recursive: bool = False) -> dict[str, Any]:
        """Remove a file or symlink; a directory with ``recursive``."""
        q = {"path": path, **_flag("recursive", recursive)}
        return dict(
            self._c.request("DELETE", f"/v1/volumes/{_wire.seg(volume)}/files/content", params=q).json()
        )


class AsyncVolumes:
    def __init__(self, client: Any) -> None:  # an AsyncClient
        self._c = client

    async def create(
        self, name: str, size_mib: int | None = None, metadata: dict[str, str] | None = None
    ) -> dict[str, Any]:
        resp = await self._c.request("POST", "/v1/volumes", json=_create_body(name, size_mib, metadata))
        return dict(resp.json())

    async def list(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        return [v async for v in self.iter(metadata, page_size=page_size)]

    def iter(
        self, metadata: dict[str, str] | None = None, *, page_size: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async def fetch(q: dict[str, Any]) -> Any:
            return (await self._c.request("GET", "/v1/volumes", params=q)).json()

        return _pages.aiterate(fetch, "volumes", _pages.params(page_size, metadata))

    async def get(self, volume: str) -> dict[str, Any]:
        return dict((await self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}")).json())

    async def delete(self, volume: str, *, force: bool = False) -> dict[str, Any]:
        resp = await self._c.request("DELETE", f"/v1/volumes/{_wire.seg(volume)}", params=_force(force))
        return dict(resp.json())

    async def resize(self, volume: str, size_mib: int) -> dict[str, Any]:
        body = {"sizeMib": size_mib}
        return dict(
            (await self._c.request("POST", f"/v1/volumes/{_wire.seg(volume)}/resize", json=body)).json()
        )

    # -- its files ----------------------------------------------------------------------

    async def list_files(self, volume: str, path: str = "", *, depth: int | None = None) -> dict[str, Any]:
        resp = await self._c.request(
            "GET", f"/v1/volumes/{_wire.seg(volume)}/files", params=_list_q(path, depth)
        )
        return dict(resp.json())

    async def stat(self, volume: str, path: str) -> dict[str, Any]:
        q = {"path": path}
        return dict(
            (await self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}/files/stat", params=q)).json()
        )

    async def exists(self, volume: str, path: str) -> bool:
        try:
            await self.stat(volume, path)
        except NotFoundError as exc:
            if exc.code == "FILE_NOT_FOUND":
                return False
            raise
        return True

    async def read_file(self, volume: str, path: str) -> FileText:
        q = {"path": path}
        resp = await self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}/files/content", params=q)
        return _wire.file_text(resp, path)

    async def read_file_bytes(self, volume: str, path: str) -> FileBytes:
        q = {"path": path}
        resp = await self._c.request("GET", f"/v1/volumes/{_wire.seg(volume)}/files/content", params=q)
        return _wire.file_bytes(resp)

    async def write_file(self, volume: str, path: str, content: str | bytes) -> dict[str, Any]:
        resp = await self._c.request(
            "PUT", f"/v1/volumes/{_wire.seg(volume)}/files/content", params={"path": path},
            content=_bytes(content), headers=_RAW,
        )  # fmt: skip
        return dict(resp.json())

    async def make_dir(self, volume: str, path: str, *, parents: bool = False) -> dict[str, Any]:
        q = {"path": path, **_flag("parents", parents)}
        return dict(
            (await self._c.request("POST", f"/v1/volumes/{_wire.seg(volume)}/files/dir", params=q)).json()
        )

    async def delete_file(self, volume: str, path: str, *, recursive: bool = False) -> dict[str, Any]:
        q = {"path": path, **_flag("recursive", recursive)}
        resp = await self._c.request("DELETE", f"/v1/volumes/{_wire.seg(volume)}/files/content", params=q)
        return dict(resp.json())
