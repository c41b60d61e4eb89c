"""The code interpreter (docs/agents.md "Code interpreter"): ``runtime.run_code(vm, code)``
and ``runtime.code.*`` for contexts, sync and async. A cell's answer is a
:class:`CodeResult`; each display result a :class:`CodeOutput` with ``png`` as bytes."""

from __future__ import annotations

import base64
import builtins
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from . import _wire

# A cell runs up to its timeout (the server's default: 300 s): the read has no limit of its own.
_CELL_TIMEOUT = _wire.exec_timeout


@dataclass(frozen=True)
class CodeError:
    name: str
    value: str
    traceback: list[str]


@dataclass(frozen=True)
class CodeOutput:
    """One display result, a MIME bundle: ``text`` (text/plain), ``html``, ``png`` (bytes),
    ``svg``, ``json``; ``is_main_result``: the cell's last expression. ``data``: as sent."""

    data: dict[str, Any]
    is_main_result: bool = False

    @property
    def text(self) -> str | None:
        return self.data.get("text/plain")

    @property
    def html(self) -> str | None:
        return self.data.get("text/html")

    @property
    def png(self) -> bytes | None:
        raw = self.data.get("image/png")
        return base64.b64decode(raw) if isinstance(raw, str) else None

    @property
    def svg(self) -> str | None:
        return self.data.get("image/svg+xml")

    @property
    def json(self) -> Any:
        return self.data.get("application/json")


@dataclass(frozen=True)
class CodeResult:
    context_id: str
    execution_count: int | None
    stdout: str
    stderr: str
    text: str | None  # the last expression's text/plain
    error: CodeError | None
    timed_out: bool = False
    results: list[CodeOutput] = field(default_factory=list)

    @property
    def pngs(self) -> list[bytes]:
        return [r.png for r in self.results if r.png is not None]


class CodeOptions(TypedDict, total=False):
    """A cell's optional fields: ``language`` python (the default) or bash; ``context`` a
    context id (default: the language's default context); ``timeout_secs``."""

    language: str
    context: str | None
    timeout_secs: float | None


class ContextOptions(TypedDict, total=False):
    """A new context's optional fields: its working directory and environment."""

    cwd: str | None
    env: dict[str, str] | None


def code_body(code: str, **opts: Unpack[CodeOptions]) -> dict[str, Any]:
    body = {"code": code, "language": opts.get("language") or "python"}
    return body | _wire.given(contextId=opts.get("context"), timeoutSecs=opts.get("timeout_secs"))


def context_body(language: str, **opts: Unpack[ContextOptions]) -> dict[str, Any]:
    return {"language": language, "env": dict(opts.get("env") or {})} | _wire.given(cwd=opts.get("cwd"))


def code_result(body: dict[str, Any]) -> CodeResult:
    err = body.get("error")
    results = [
        CodeOutput({k: v for k, v in r.items() if k != "isMainResult"}, bool(r.get("isMainResult")))
        for r in body.get("results", [])
    ]
    return CodeResult(
        context_id=body["contextId"],
        execution_count=body.get("executionCount"),
        stdout=body.get("stdout", ""),
        stderr=body.get("stderr", ""),
        text=body.get("text"),
        error=CodeError(err["name"], err["value"], list(err["traceback"])) if err else None,
        timed_out=bool(body.get("timedOut")),
        results=results,
    )


class Code(_wire.RuntimeCalls):
    """``runtime.code``: cells and contexts of a VM's kernels."""

    def run(self, vm_id: str, code: str, **opts: Unpack[CodeOptions]) -> CodeResult:
        body = code_body(code, **opts)
        timeout = _CELL_TIMEOUT(self._c.timeout)
        return code_result(self._json("POST", f"/vms/{_wire.seg(vm_id)}/code", json=body, timeout=timeout))

    def create_context(
        self, vm_id: str, language: str = "python", **opts: Unpack[ContextOptions]
    ) -> dict[str, Any]:
        body = context_body(language, **opts)
        timeout = _CELL_TIMEOUT(self._c.timeout)
        return dict(self._json("POST", f"/vms/{_wire.seg(vm_id)}/code/contexts", json=body, timeout=timeout))

    def list_contexts(self, vm_id: str) -> builtins.list[dict[str, Any]]:
        return list(self._json("GET", f"/vms/{_wire.seg(vm_id)}/code/contexts")["contexts"])

    def delete_context(self, vm_id: str, context: str) -> dict[str, Any]:
        return dict(self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/code/contexts/{_wire.seg(context)}"))

    def interrupt(self, vm_id: str, context: str) -> dict[str, Any]:
        return dict(
            self._json("POST", f"/vms/{_wire.seg(vm_id)}/code/contexts/{_wire.seg(context)}/interrupt")
        )


class AsyncCode(_wire.AsyncRuntimeCalls):
    """``AsyncClient.runtime.code``: :class:`Code`'s calls, awaited."""

    async def run(self, vm_id: str, code: str, **opts: Unpack[CodeOptions]) -> CodeResult:
        body = code_body(code, **opts)
        timeout = _CELL_TIMEOUT(self._c.timeout)
        return code_result(
            await self._json("POST", f"/vms/{_wire.seg(vm_id)}/code", json=body, timeout=timeout)
        )

    async def create_context(
        self, vm_id: str, language: str = "python", **opts: Unpack[ContextOptions]
    ) -> dict[str, Any]:
        body = context_body(language, **opts)
        timeout = _CELL_TIMEOUT(self._c.timeout)
        return dict(
            await self._json("POST", f"/vms/{_wire.seg(vm_id)}/code/contexts", json=body, timeout=timeout)
        )

    async def list_contexts(self, vm_id: str) -> builtins.list[dict[str, Any]]:
        return list((await self._json("GET", f"/vms/{_wire.seg(vm_id)}/code/contexts"))["contexts"])

    async def delete_context(self, vm_id: str, context: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/code/contexts/{_wire.seg(context)}"))

    async def interrupt(self, vm_id: str, context: str) -> dict[str, Any]:
        return dict(
            await self._json("POST", f"/vms/{_wire.seg(vm_id)}/code/contexts/{_wire.seg(context)}/interrupt")
        )
