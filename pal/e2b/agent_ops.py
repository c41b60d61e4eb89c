"""envd's ``/envs`` and ``/metrics`` (:class:`ops.AgentInfoOps`) and the code interpreter
(:class:`ops.InterpreterOps`) over the scheduler's reads and Pal's code contexts (one
Jupyter kernel a context, docs/agents.md), each a guest verb through :class:`GuestCalls`.

A cell's ``envs`` are set in its kernel for that cell only and put back after it, as
E2B's interpreter does (pal/guest/kerneldriver.py); a restart starts a fresh kernel under
the context's id. What differs from E2B's interpreter: languages are Python and bash (Pal's
kernels).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import ValidationError

from pal.errors import InvalidRequest
from pal.scheduler.guest import GuestCalls
from pal.scheduler.reads import Reads
from pal.wire import verbs
from pal.wire.code import CodeRun, ContextNew, ContextRef
from pal.wire.models import VmRef

from . import conventions as conv
from . import ops

LANGUAGES = {"python": "python", "python3": "python", "bash": "bash", "sh": "bash"}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _language(language: str | None) -> str:
    if language is None or language == "":
        return "python"
    if language.lower() not in LANGUAGES:
        raise InvalidRequest(f"language {language!r} is not served here: python or bash")
    return LANGUAGES[language.lower()]


@dataclass(frozen=True)
class PalAgentInfo:
    reads: Reads

    async def envs(self, caller: ops.Caller) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH, **conv.process_env(caller.sandbox_id, caller.user, {})}

    async def metrics(self, caller: ops.Caller) -> ops.AgentMetrics:
        vm = await self.reads.get(caller.tenant, caller.sandbox_id)
        got = await self.reads.metrics(caller.tenant, caller.sandbox_id)
        cpus = int((vm.limits or {}).get("vcpus") or 1)
        last = got.samples[-1] if got.samples else None
        mem_total = int((vm.limits or {}).get("memoryMib") or 0) << 20
        if last is None:
            return ops.AgentMetrics(int(time.time()), cpus, 0.0, mem_total, 0, 0, 0, 0)
        return ops.AgentMetrics(
            ts=last.t // 1000,
            cpu_count=cpus,
            cpu_used_pct=round((last.cpu_pct or 0.0) / cpus, 2),
            mem_total=last.guest_mem_total_bytes or mem_total,
            mem_used=last.guest_mem_used_bytes or last.rss_bytes or 0,
            mem_cache=0,
            disk_used=last.disk_used_bytes or 0,
            disk_total=last.disk_total_bytes or 0,
        )


@dataclass(frozen=True)
class PalInterpreter:
    guest: GuestCalls

    def execute(
        self,
        caller: ops.Caller,
        code: str,
        *,
        language: str | None,
        context_id: str | None,
        envs: Mapping[str, str],
    ) -> AsyncIterator[ops.CellEvent]:
        body: dict[str, object] = {"vmId": caller.sandbox_id, "code": code, "env": dict(envs)}
        if context_id is not None:
            body["contextId"] = context_id
        else:
            body["language"] = _language(language)
        try:
            req = CodeRun.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidRequest(
                f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg')}"
            ) from None

        async def events() -> AsyncIterator[ops.CellEvent]:
            async for ev in self.guest.stream(caller.tenant, verbs.RUN_CODE, req):
                if ev.type in ("stdout", "stderr"):
                    yield ops.CellOutput(ev.type, ev.text or "", datetime.now(UTC))  # type: ignore[arg-type]
                elif ev.type == "result":
                    yield ops.CellResult(dict(ev.data or {}), bool(ev.is_main_result))
                elif ev.type == "error" and ev.error is not None:
                    yield ops.CellError(ev.error.name, ev.error.value, "\n".join(ev.error.traceback))
                elif ev.type == "end":
                    yield ops.CellDone(ev.execution_count or 0)

        return events()

    async def create_context(
        self, caller: ops.Caller, language: str | None, cwd: str | None
    ) -> ops.CodeContext:
        req = ContextNew.model_validate(
            {
                "vmId": caller.sandbox_id,
                "language": _language(language),
                "cwd": conv.absolute(caller.user, cwd) if cwd else conv.home_of(caller.user),
                "env": conv.process_env(caller.sandbox_id, caller.user, {}),
            }
        )
        made = await self.guest.call(caller.tenant, verbs.CREATE_CONTEXT, req)
        return ops.CodeContext(made.context_id, made.language, made.cwd)

    async def list_contexts(self, caller: ops.Caller) -> list[ops.CodeContext]:
        listed = await self.guest.call(caller.tenant, verbs.LIST_CONTEXTS, VmRef(vm_id=caller.sandbox_id))
        return [ops.CodeContext(c.context_id, c.language, c.cwd) for c in listed.contexts]

    async def remove_context(self, caller: ops.Caller, context_id: str) -> None:
        ref = ContextRef(vm_id=caller.sandbox_id, context_id=context_id)
        await self.guest.call(caller.tenant, verbs.DELETE_CONTEXT, ref)

    async def restart_context(self, caller: ops.Caller, context_id: str) -> None:
        ref = ContextRef(vm_id=caller.sandbox_id, context_id=context_id)
        await self.guest.call(caller.tenant, verbs.RESTART_CONTEXT, ref)
