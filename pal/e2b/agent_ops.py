"""envd's ``/envs`` and ``/metrics`` (:class:`ops.AgentInfoOps`) and the code interpreter
(:class:`ops.InterpreterOps`) over the scheduler's reads and Pal's code contexts (one
Jupyter kernel a context, docs/agents.md), each a guest verb through :class:`GuestCalls`.

What differs from E2B's interpreter: languages are Python and bash (Pal's kernels); a
cell's ``envs`` are not applied (Pal sets a context's environment when it is made);
restarting a context is not served (remove it and make another).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from pal.errors import InvalidRequest, PalError
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
        body: dict[str, object] = {"vmId": caller.sandbox_id, "code": code}
        if context_id is not None:
            body["contextId"] = context_id
        else:
            body["language"] = _language(language)
        req = CodeRun.model_validate(body)

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
        raise PalError("restarting a context is not served by Pal: remove it and create another", status=501)
