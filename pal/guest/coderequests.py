"""The host's code-context requests (protocol.py: cnew, clist, cdelete, cinterrupt,
crestart, crun).

Each runs on its own request thread (the harness starts it); ``crun`` holds its thread
while the cell runs and sends the cell's events as ``cev`` messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pal.guest import protocol as P
from pal.guest.errors import ExecError
from pal.guest.kernels import ContextSpec, Emit, Kernels, language_of

MAX_TIMEOUT_S = 24 * 3600.0
DEFAULT_TIMEOUT_S = 300.0  # a cell without a timeout (the host always sends one)

Reply = Callable[..., bool]
SpecFor = Callable[[str, Any, Any], ContextSpec]  # (language, cwd, env) -> spec


def default_id(language: str) -> str:
    return f"default-{language}"


class CodeRequests:
    def __init__(self, kernels: Kernels, reply: Reply, spec_for: SpecFor) -> None:
        self.kernels = kernels
        self.reply = reply
        self.spec_for = spec_for

    def handle(self, rid: int, kind: str, msg: P.Message) -> None:
        if kind == P.K_CRUN:
            self._run(rid, msg)
            return
        if kind == P.K_CNEW:
            spec = self.spec_for(language_of(msg.get("language")), msg.get("cwd"), msg.get("env"))
            result: dict[str, Any] = {"context": self.kernels.start(spec).info()}
        elif kind == P.K_CLIST:
            result = {"contexts": self.kernels.list()}
        elif kind == P.K_CDELETE:
            self.kernels.delete(msg.get("ctx"))
            result = {"ctx": msg.get("ctx"), "deleted": True}
        elif kind == P.K_CRESTART:
            result = {"context": self.kernels.restart(msg.get("ctx")).info()}
        elif kind == P.K_CINTERRUPT:
            result = {"ctx": msg.get("ctx"), "interrupted": self.kernels.interrupt(msg.get("ctx"))}
        else:
            raise ExecError(P.ERR_INVAL, f"unknown code request {kind!r}")
        self.reply(rid, P.K_OK, result=result)

    def _run(self, rid: int, msg: P.Message) -> None:
        code = msg.get("code")
        if not isinstance(code, str) or len(code) > P.MAX_CODE_CHARS:
            raise ExecError(P.ERR_INVAL, f"code must be a string of at most {P.MAX_CODE_CHARS} characters")
        timeout = msg.get("timeout")
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_S
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not number or not 0 < timeout <= MAX_TIMEOUT_S:
            raise ExecError(P.ERR_INVAL, "timeout must be a positive number of seconds")
        ctx_id = msg.get("ctx")
        if ctx_id is None:
            language = language_of(msg.get("language", "python"))
            try:  # started already (most cells): no environment nor python3 to resolve again
                ctx = self.kernels.get(default_id(language))
            except ExecError:
                ctx = self.kernels.start(self.spec_for(language, None, None), default_id(language))
        else:
            ctx = self.kernels.get(ctx_id)
            asked = msg.get("language")
            if asked is not None and asked != ctx.language:
                raise ExecError(P.ERR_INVAL, f"context {ctx.id} runs {ctx.language}, not {asked!r}")
        env = msg.get("env")
        if env is not None and not (
            isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise ExecError(P.ERR_INVAL, "env must be an object of strings")
        emit: Emit = lambda ev: self.reply(rid, P.K_CEV, **ev)  # noqa: E731
        end = self.kernels.run(rid, ctx, code, float(timeout), emit, env)
        self.reply(rid, P.K_OK, result=end)
