"""Code contexts (issue 26; docs/agents.md "Code interpreter"): stateful kernels in the guest.

A context is one driver process (kerneldriver.py, as the workload user) holding one
kernel: ipykernel for ``python`` (under the image's python3, which must have Jupyter),
a persistent bash for ``bash``. The harness speaks JSON lines to it and turns a cell's
events into ``cev`` messages of the host's ``crun`` stream. Each language has a default
context (``default-python``, ``default-bash``), started on first use.

Bounds (the host checks them again): MAX_CONTEXTS per VM, MAX_CODE_CHARS per cell,
MAX_STREAM_CHARS of stdout+stderr and MAX_RESULTS_BYTES of display results per cell, one
cell at a time per context. A cell past its timeout is interrupted (SIGINT to the
kernel) and the context stays; a kernel that ignores the interrupt for INTERRUPT_GRACE_S
is killed and its context removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pal.guest import protocol as P
from pal.guest.children import ChildTracker, kill_group
from pal.guest.errors import ExecError
from pal.guest.oslib import now_ms

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kerneldriver.py")
LANGUAGES = ("python", "bash")
START_TIMEOUT_S = 180.0  # a kernel start (ipykernel imports under TCG take seconds)
INTERRUPT_GRACE_S = 10.0  # after the timeout's SIGINT, how long the cell may take to stop

Emit = Callable[[P.Message], bool]


@dataclass(eq=False)
class Context:
    id: str
    language: str
    cwd: str
    popen: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)  # the VM's part of its environment
    own_env: dict[str, str] = field(default_factory=dict)  # the context's own (cnew's env)
    kernel_pid: int = 0
    created_ms: int = field(default_factory=now_ms)
    executions: int = 0
    running: bool = False
    spec: ContextSpec | None = None  # what it was started from (a restart starts it again)
    events: queue.Queue[P.Message | None] = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def info(self) -> P.Message:
        return {
            "id": self.id,
            "language": self.language,
            "cwd": self.cwd,
            "created_ms": self.created_ms,
            "executions": self.executions,
            "running": self.running,
        }

    def send(self, req: P.Message) -> None:
        assert self.popen.stdin is not None
        with self.send_lock:
            self.popen.stdin.write(json.dumps(req).encode() + b"\n")
            self.popen.stdin.flush()


@dataclass
class ContextSpec:
    """A context to start, checked and resolved by the harness (env, cwd, credentials)."""

    language: str
    env: dict[str, str]
    cwd: str
    vm_env: dict[str, str]  # what of ``env`` is the VM's (identity, secrets), not the request's
    creds: dict[str, Any]
    python: str | None = None  # the image's python3 (for ``python``)


def language_of(value: Any) -> str:
    if value not in LANGUAGES:
        raise ExecError(P.ERR_INVAL, f"language must be one of {', '.join(LANGUAGES)}")
    return str(value)


def _read_events(ctx: Context) -> None:
    """The driver's events into the context's queue; None once it exits."""
    assert ctx.popen.stdout is not None
    for line in iter(ctx.popen.stdout.readline, b""):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            ctx.events.put(ev)
    ctx.events.put(None)


class Kernels:
    """The VM's code contexts by id."""

    def __init__(self, children: ChildTracker) -> None:
        self.children = children
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # one start at a time: bounded, no double default
        self._contexts: dict[str, Context] = {}
        self._runs: dict[int, Context] = {}  # running cells by request id (cancel)

    def list(self) -> list[P.Message]:
        with self._lock:
            return [c.info() for c in sorted(self._contexts.values(), key=lambda c: c.created_ms)]

    def get(self, ctx_id: Any) -> Context:
        with self._lock:
            ctx = self._contexts.get(ctx_id) if isinstance(ctx_id, str) else None
        if ctx is None:
            raise ExecError(P.ERR_NOENT, f"no code context {ctx_id!r}")
        return ctx

    def busy(self) -> bool:
        with self._lock:
            return any(c.running for c in self._contexts.values())

    # -- start and stop

    def start(self, spec: ContextSpec, ctx_id: str | None = None) -> Context:
        with self._start_lock:
            with self._lock:
                if ctx_id is not None and ctx_id in self._contexts:
                    return self._contexts[ctx_id]  # a default someone else just started
                if len(self._contexts) >= P.MAX_CODE_CONTEXTS:
                    raise ExecError(P.ERR_LIMIT, f"{P.MAX_CODE_CONTEXTS} code contexts exist already")
            ctx = self._spawn(spec, ctx_id or "ctx-" + secrets.token_hex(6))
            with self._lock:
                self._contexts[ctx.id] = ctx
            return ctx

    def _spawn(self, spec: ContextSpec, ctx_id: str) -> Context:
        exe = spec.python if spec.language == "python" else sys.executable
        if not exe:
            raise ExecError(P.ERR_NOKERNEL, "this image has no python3 for a Python kernel")
        argv = [exe, DRIVER, spec.language]
        if spec.language == "bash":  # Pal's own interpreter: as the harness runs it
            argv = [*_own_interpreter(), DRIVER, "bash"]
        with self.children.spawn_lock:
            popen = subprocess.Popen(
                argv,
                cwd=spec.cwd,
                env=spec.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_default_signals,
                **spec.creds,
            )
            self.children.register(popen.pid)
        own = {k: v for k, v in spec.env.items() if spec.vm_env.get(k) != v}
        ctx = Context(
            id=ctx_id,
            language=spec.language,
            cwd=spec.cwd,
            popen=popen,
            env=spec.vm_env,
            own_env=own,
            spec=spec,
        )
        threading.Thread(target=_read_events, args=(ctx,), name=f"ctx-{ctx_id}", daemon=True).start()
        try:
            first = ctx.events.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            first = None
        if not first or first.get("t") != "ready":
            self._kill(ctx)
            why = str(first.get("msg", ""))[:500] if first else "it did not start in time"
            code = P.ERR_NOKERNEL if first and "no Jupyter" in why else P.ERR_IO
            raise ExecError(code, why or "the kernel did not start")
        pid = first.get("kernel_pid")
        ctx.kernel_pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1 else 0
        return ctx

    def _kill(self, ctx: Context) -> None:
        if ctx.kernel_pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(ctx.kernel_pid, signal.SIGKILL)
            kill_group(ctx.kernel_pid)
        kill_group(ctx.popen.pid)
        if ctx.popen.stdin is not None:
            with contextlib.suppress(OSError):
                ctx.popen.stdin.close()
        self.children.wait(ctx.popen.pid, 5.0)
        self.children.release(ctx.popen.pid)

    def restart(self, ctx_id: Any) -> Context:
        """A fresh kernel under the context's id, from the spec it was started with (the
        VM's environment as it is now, its own variables): its state is gone. A cell
        running in the old one ends as lost. A kernel that fails to start leaves no context."""
        old = self.get(ctx_id)
        assert old.spec is not None
        spec = dataclasses.replace(old.spec, env={**old.env, **old.own_env}, vm_env=dict(old.env))
        with self._start_lock:
            self._kill(old)
            with self._lock:
                if self._contexts.get(old.id) is old:
                    del self._contexts[old.id]
            ctx = self._spawn(spec, old.id)
            with self._lock:
                self._contexts[ctx.id] = ctx
        return ctx

    def delete(self, ctx_id: Any) -> None:
        ctx = self.get(ctx_id)
        with self._lock:
            self._contexts.pop(ctx.id, None)
        self._kill(ctx)

    def rekey(self, vm_env: dict[str, str], hostname: str, reseed: bool) -> None:
        """The VM took a new identity (restore, fork, pool claim): each kernel's environment
        follows it (what changed of the VM's part; a context's own variables win) and, when
        it is another VM's, its RNG is reseeded (kerneldriver.py, ``rekey``). A template's or
        a pooled VM's kernel started under another identity; a fork's must not share its
        parent's RNG."""
        with self._lock:
            contexts = list(self._contexts.values())
        extra = {"hostname": hostname, "reseed": reseed}
        for ctx in contexts:
            old, new = {**ctx.env, **ctx.own_env}, {**vm_env, **ctx.own_env}
            sets = {k: v for k, v in new.items() if old.get(k) != v}
            unsets = [k for k in old if k not in new]
            ctx.env = dict(vm_env)
            with contextlib.suppress(OSError):
                ctx.send({"op": "rekey", "set": sets, "unset": unsets, **extra})

    def interrupt(self, ctx_id: Any) -> bool:
        ctx = self.get(ctx_id)
        if not ctx.running:
            return False
        with contextlib.suppress(OSError):
            ctx.send({"op": "interrupt"})
        return True

    def cancel(self, rid: Any) -> bool:
        """The host gave up on a cell's stream: interrupt the cell."""
        with self._lock:
            ctx = self._runs.get(rid) if isinstance(rid, int) else None
        if ctx is None:
            return False
        with contextlib.suppress(OSError):
            ctx.send({"op": "interrupt"})
        return True

    # -- cells

    def run(
        self, rid: int, ctx: Context, code: str, timeout: float, emit: Emit, env: dict[str, str] | None = None
    ) -> P.Message:
        """Run one cell, each event through ``emit``; the end's result. ``env``: set in
        the kernel for this cell only (kerneldriver.py restores what was there after it)."""
        if not ctx.lock.acquire(blocking=False):
            raise ExecError(P.ERR_STATE, f"a cell is running in context {ctx.id} already")
        try:
            ctx.running = True
            with self._lock:
                self._runs[rid] = ctx
            try:
                ctx.send({"op": "run", "code": code, **({"env": env} if env else {})})
            except OSError:
                self._forget(ctx)
                raise ExecError(P.ERR_STATE, f"the kernel of context {ctx.id} has exited") from None
            return self._follow(ctx, timeout, emit)
        finally:
            with self._lock:
                self._runs.pop(rid, None)
            ctx.running = False
            ctx.lock.release()

    def _follow(self, ctx: Context, timeout: float, emit: Emit) -> P.Message:
        bound = CellBound(emit)
        deadline = time.monotonic() + timeout
        timed_out = False
        while True:
            left = deadline - time.monotonic()
            try:
                ev = ctx.events.get(timeout=max(0.0, left))
            except queue.Empty:
                if timed_out:  # the interrupt did not stop it: the kernel goes
                    self._forget(ctx)
                    bound.note("the kernel ignored the interrupt and was stopped; its context is gone")
                    return {"context_id": ctx.id, "execution_count": None, "timed_out": True, "lost": True}
                timed_out = True
                deadline = time.monotonic() + INTERRUPT_GRACE_S
                with contextlib.suppress(OSError):
                    ctx.send({"op": "interrupt"})
                continue
            if ev is None:
                self._forget(ctx)
                bound.note("the kernel exited; its context is gone")
                return {"context_id": ctx.id, "execution_count": None, "timed_out": timed_out, "lost": True}
            if ev.get("t") == "done":
                ctx.executions += 1
                count = ev.get("count")
                count = count if isinstance(count, int) and not isinstance(count, bool) else None
                return {"context_id": ctx.id, "execution_count": count, "timed_out": timed_out}
            bound.forward(ev)

    def _forget(self, ctx: Context) -> None:
        with self._lock:
            if self._contexts.get(ctx.id) is ctx:
                del self._contexts[ctx.id]
        self._kill(ctx)


class CellBound:
    """One cell's events, checked and bounded before they go to the host: stream text and
    error events together within MAX_CELL_STREAM_CHARS (each event with its overhead:
    protocol.cell_event_chars), display results within MAX_CELL_RESULTS and
    MAX_CELL_RESULT_BYTES. What is past a bound is dropped, and said once (a note from
    CELL_NOTE_RESERVE). The host counts the same way (pal/manager/code.py)."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.chars = 0  # of stream and error events sent, notes included
        self.result_bytes = 0
        self.results = 0
        self.cut_text = self.cut_results = False

    def note(self, text: str) -> None:
        line = f"[pal: {text}]\n"
        cost = P.cell_event_chars(line)
        if self.chars + cost <= P.MAX_CELL_STREAM_CHARS + P.CELL_NOTE_RESERVE:
            self.chars += cost
            self.emit({"t": "stream", "name": "stderr", "text": line})

    def _text_over(self) -> None:
        if not self.cut_text:
            self.cut_text = True
            self.note(f"output and errors cut at {P.MAX_CELL_STREAM_CHARS} characters")

    def _results_over(self, why: str) -> None:
        if not self.cut_results:
            self.cut_results = True
            self.note(why)

    def forward(self, ev: P.Message) -> None:
        t = ev.get("t")
        if t == "stream" and ev.get("name") in ("stdout", "stderr") and isinstance(ev.get("text"), str):
            text = ev["text"]
            for i in range(0, max(len(text), 1), P.STREAM_EVENT_CHARS):
                room = P.MAX_CELL_STREAM_CHARS - self.chars - P.CELL_EVENT_OVERHEAD
                if room <= 0:
                    self._text_over()
                    return
                piece = text[i : i + min(P.STREAM_EVENT_CHARS, room)]
                if not piece:
                    return
                self.chars += P.cell_event_chars(piece)
                self.emit({"t": "stream", "name": ev["name"], "text": piece})
                if len(piece) < min(P.STREAM_EVENT_CHARS, len(text) - i):
                    self._text_over()
                    return
        elif t == "result" and isinstance(ev.get("data"), dict):
            data = {k: v for k, v in ev["data"].items() if k in P.CODE_MIMES and isinstance(v, str)}
            size = len(json.dumps(data))
            if size > P.MAX_RESULT_BYTES:
                self._results_over(f"display results over {P.MAX_RESULT_BYTES} bytes each were dropped")
                return
            if self.results >= P.MAX_CELL_RESULTS or self.result_bytes + size > P.MAX_CELL_RESULT_BYTES:
                self._results_over("display results dropped: the cell's results are over Pal's bound")
                return
            self.results += 1
            self.result_bytes += size
            # ``mime``, not ``data``: on the wire ``data`` is a message's binary payload.
            self.emit({"t": "result", "mime": data, "main": ev.get("main") is True})
        elif t == "error":
            tb = ev.get("traceback")
            tb = [str(x)[:10_000] for x in tb[:200]] if isinstance(tb, list) else []
            name, value = str(ev.get("name"))[:200], str(ev.get("value"))[:10_000]
            cost = P.cell_event_chars(name, value, *tb)
            if self.chars + cost > P.MAX_CELL_STREAM_CHARS:
                tb, value = [], value[:1000]  # the error without its traceback, if that fits
                cost = P.cell_event_chars(name, value)
                if self.chars + cost > P.MAX_CELL_STREAM_CHARS:
                    self._text_over()
                    return
            self.chars += cost
            self.emit({"t": "error", "name": name, "value": value, "traceback": tb})


def _own_interpreter() -> list[str]:
    """How the harness itself runs (in the guest: Pal's loader and python3; tests: this one)."""
    loader = "/.pal/lib/ld-linux-x86-64.so.2"
    if sys.executable.startswith("/.pal/") and os.path.exists(loader):
        lib = ["--library-path", "/.pal/lib", "--inhibit-cache"]
        return [loader, *lib, sys.executable, "-I", "-S", "-X", "utf8"]
    return [sys.executable]


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
