"""``client.volumes``: volumes, storage that outlives a VM (docs/volumes.md). A volume is
named by its id or its name; answers are the server's camelCase JSON dicts
(``{volumeId, name, sizeMib, state, metadata, createdAt, updatedAt}``)."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Iterator
from typing import Any

from . import _pages, _wire


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
