"""An in-memory binding of pal/e2b's operations (pal.e2b.ops), for the protocol layer's
tests: sandboxes as rows, files as a dict, processes as a few scripted commands.

It models what the E2B surface must translate, not Pal: the real binding (phase 2 of
issue 40) runs on the scheduler's operations and real VMs. Scripted commands (the text
after ``bash -l -c``): ``echo X``, ``echo X >&2``, ``exit N``, ``cat`` (echoes stdin until
it is closed), ``sleep`` (until a signal), ``pwd``, ``env NAME``; anything else exits 127.
"""

from __future__ import annotations

import asyncio
import itertools
import posixpath
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from pal.e2b import ops
from pal.e2b.access import new_access_token
from pal.e2b.errors import ALREADY_EXISTS
from pal.errors import Conflict, InvalidRequest, NotFound

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
HOME = "/home/user"


@dataclass
class FakeProcess:
    pid: int
    spec: ops.ProcessSpec
    events: list[ops.ProcessEvent] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    stdin_open: bool = True
    ended: bool = False
    size: tuple[int, int] | None = None

    def emit(self, event: ops.ProcessEvent) -> None:
        self.events.append(event)
        if isinstance(event, ops.ProcessEnded):
            self.ended = True
        self.changed.set()
        self.changed = asyncio.Event()

    async def follow(self, start: int) -> AsyncIterator[ops.ProcessEvent]:
        i = start
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                return
            await self.changed.wait()


@dataclass
class FakeSandbox:
    tenant: str
    sandbox: ops.Sandbox
    env: dict[str, str]
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/home", HOME, "/tmp"})
    meta: dict[str, dict[str, str]] = field(default_factory=dict)
    processes: dict[int, FakeProcess] = field(default_factory=dict)
    watchers: list[tuple[ops.Watch, asyncio.Queue[ops.FsEvent]]] = field(default_factory=list)
    polled: dict[str, tuple[ops.Watch, list[ops.FsEvent]]] = field(default_factory=dict)
    contexts: dict[str, ops.CodeContext] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)


class FakePal:
    """Every Protocol of pal.e2b.ops over one in-memory state, keyed by tenant."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self.keys = dict(keys)  # api key -> tenant
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.ids = itertools.count(1)
        self.pids = itertools.count(100)
        self.calls: list[str] = []

    # -- keys and access -----------------------------------------------------------------

    async def check_key(self, key: str) -> tuple[str | None, str | None]:
        tenant = self.keys.get(key)
        return (tenant, None) if tenant else (None, "invalid API key")

    async def access(self, sandbox_id: str) -> ops.SandboxAccess | None:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            return None
        s = sb.sandbox
        return ops.SandboxAccess(sb.tenant, s.sandbox_id, s.access_token, s.state == "running")

    def _own(self, tenant: str, sandbox_id: str) -> FakeSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.tenant != tenant:
            raise NotFound(f"sandbox {sandbox_id} not found")
        return sb

    def _set(self, sb: FakeSandbox, **changes: object) -> None:
        sb.sandbox = replace(sb.sandbox, **changes)  # type: ignore[arg-type]

    # -- SandboxOps -----------------------------------------------------------------------

    async def create(self, tenant: str, spec: ops.CreateSandbox) -> ops.Sandbox:
        self.calls.append(f"create {spec.template}")
        if spec.template not in ("base", "code-interpreter-v1"):
            raise NotFound(f"template {spec.template!r} not found")
        sid = f"vm-{next(self.ids):024x}"
        s = ops.Sandbox(
            sandbox_id=sid,
            template_id=spec.template,
            alias=spec.template,
            state="running",
            started_at=NOW,
            end_at=NOW + timedelta(seconds=spec.timeout_s),
            cpu_count=2,
            memory_mb=512,
            disk_size_mb=2048,
            metadata=dict(spec.metadata),
            access_token=new_access_token() if spec.secure else None,
            auto_pause=spec.auto_pause,
            auto_resume=spec.auto_resume,
            allow_internet=spec.network.allow_internet,
        )
        self.sandboxes[sid] = FakeSandbox(tenant, s, env={"E2B_SANDBOX": "true", **spec.env_vars})
        return s

    async def get(self, tenant: str, sandbox_id: str) -> ops.Sandbox:
        return self._own(tenant, sandbox_id).sandbox

    async def list_sandboxes(self, tenant: str, query: ops.SandboxQuery) -> ops.Page[ops.Sandbox]:
        rows = [
            sb.sandbox
            for sb in self.sandboxes.values()
            if sb.tenant == tenant
            and (not query.states or sb.sandbox.state in query.states)
            and all(sb.sandbox.metadata.get(k) == v for k, v in query.metadata.items())
        ]
        rows.sort(key=lambda s: s.sandbox_id, reverse=query.order == "desc")
        start = int(query.next_token or 0)
        page = rows[start : start + query.limit]
        more = start + query.limit < len(rows)
        return ops.Page(page, str(start + query.limit) if more else None)

    async def kill(self, tenant: str, sandbox_id: str) -> None:
        self._own(tenant, sandbox_id)
        del self.sandboxes[sandbox_id]

    async def set_timeout(self, tenant: str, sandbox_id: str, timeout_s: int) -> None:
        sb = self._own(tenant, sandbox_id)
        self._set(sb, end_at=NOW + timedelta(seconds=timeout_s))

    async def pause(self, tenant: str, sandbox_id: str, keep_memory: bool) -> None:
        sb = self._own(tenant, sandbox_id)
        if sb.sandbox.state == "paused":
            raise Conflict(f"sandbox {sandbox_id} is already paused")
        self._set(sb, state="paused")

    async def connect(self, tenant: str, sandbox_id: str, timeout_s: int) -> tuple[ops.Sandbox, bool]:
        sb = self._own(tenant, sandbox_id)
        resumed = sb.sandbox.state == "paused"
        end = max(sb.sandbox.end_at, NOW + timedelta(seconds=timeout_s))
        self._set(sb, state="running", end_at=end)
        return sb.sandbox, resumed

    async def fork(self, tenant: str, sandbox_id: str, count: int, timeout_s: int) -> list[ops.ForkOutcome]:
        src = self._own(tenant, sandbox_id)
        out = []
        for i in range(count):
            if i == 2:  # the third fork fails, to show a per-fork error
                out.append(ops.ForkOutcome(error_status=429, error_message="no capacity for this fork"))
                continue
            child = await self.create(
                tenant,
                ops.CreateSandbox(
                    src.sandbox.template_id, timeout_s, secure=src.sandbox.access_token is not None
                ),
            )
            self.sandboxes[child.sandbox_id].files = dict(src.files)
            out.append(ops.ForkOutcome(sandbox=child))
        return out

    async def metrics(
        self, tenant: str, sandbox_id: str, start: datetime | None, end: datetime | None
    ) -> list[ops.MetricSample]:
        self._own(tenant, sandbox_id)
        return [
            ops.MetricSample(
                NOW + timedelta(seconds=5 * i), 2, 12.5 * i, 100 << 20, 512 << 20, 10 << 20, 1 << 30, 2 << 30
            )
            for i in range(3)
        ]

    async def logs(
        self, tenant: str, sandbox_id: str, since: datetime | None, limit: int
    ) -> list[ops.LogEntry]:
        self._own(tenant, sandbox_id)
        return [ops.LogEntry(NOW, "info", "sandbox started")][:limit]

    async def update_network(self, tenant: str, sandbox_id: str, network: ops.NetworkPolicy) -> None:
        sb = self._own(tenant, sandbox_id)
        self._set(sb, allow_internet=network.allow_internet)

    async def create_snapshot(self, tenant: str, sandbox_id: str, name: str | None) -> ops.Snapshot:
        self._own(tenant, sandbox_id)
        return ops.Snapshot(f"snap-{sandbox_id}:default", (f"{name or 'snap'}:default",))

    async def list_snapshots(
        self, tenant: str, sandbox_id: str | None, name: str | None, limit: int, next_token: str | None
    ) -> ops.Page[ops.Snapshot]:
        return ops.Page([ops.Snapshot("snap-1:default", ("snap:default",))])

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None:
        if snapshot_id != "snap-1:default":
            raise NotFound(f"snapshot {snapshot_id} not found")

    async def templates(self, tenant: str) -> list[ops.Template]:
        return [ops.Template("base", ("base",), 2, 512, 2048, NOW)]

    # -- FilesystemOps --------------------------------------------------------------------

    @staticmethod
    def _abs(caller: ops.Caller, path: str) -> str:
        home = "/root" if caller.user == "root" else HOME
        return posixpath.normpath(posixpath.join(home, path))

    def _entry(self, sb: FakeSandbox, path: str) -> ops.Entry:
        name = posixpath.basename(path) or "/"
        if path in sb.dirs:
            return ops.Entry(
                name, path, ops.FileType.DIRECTORY, 4096, 0o40755, "drwxr-xr-x", "user", "user", NOW
            )
        if path in sb.files:
            data = sb.files[path]
            return ops.Entry(
                name,
                path,
                ops.FileType.FILE,
                len(data),
                0o100644,
                "-rw-r--r--",
                "user",
                "user",
                NOW,
                metadata=sb.meta.get(path, {}),
            )
        raise NotFound(f"path '{path}' does not exist")

    def _notify(self, sb: FakeSandbox, path: str, kind: ops.FsEventType) -> None:
        sinks = [(w, q.put_nowait) for w, q in sb.watchers] + [
            (w, got.append) for w, got in sb.polled.values()
        ]
        for watch, put in sinks:
            parent = posixpath.dirname(path)
            if parent == watch.path or (watch.recursive and path.startswith(watch.path + "/")):
                with_entry = watch.include_entry and kind != ops.FsEventType.REMOVE
                put(
                    ops.FsEvent(
                        posixpath.relpath(path, watch.path),
                        kind,
                        self._entry(sb, path) if with_entry else None,
                    )
                )

    async def stat(self, caller: ops.Caller, path: str) -> ops.Entry:
        sb = self.sandboxes[caller.sandbox_id]
        return self._entry(sb, self._abs(caller, path))

    async def list_dir(self, caller: ops.Caller, path: str, depth: int) -> list[ops.Entry]:
        sb = self.sandboxes[caller.sandbox_id]
        root = self._abs(caller, path)
        if root not in sb.dirs:
            raise NotFound(f"path '{root}' does not exist")
        out = []
        for p in sorted(sb.dirs | set(sb.files)):
            if p != root and p.startswith(root.rstrip("/") + "/"):
                rel = p[len(root.rstrip("/")) + 1 :]
                if rel.count("/") < depth:
                    out.append(self._entry(sb, p))
        return out

    async def make_dir(self, caller: ops.Caller, path: str) -> ops.Entry:
        sb = self.sandboxes[caller.sandbox_id]
        full = self._abs(caller, path)
        if full in sb.dirs:
            raise Conflict(f"directory '{full}' already exists", code=ALREADY_EXISTS)
        parts = full.split("/")
        for i in range(2, len(parts) + 1):
            sb.dirs.add("/".join(parts[:i]))
        self._notify(sb, full, ops.FsEventType.CREATE)
        return self._entry(sb, full)

    async def move(self, caller: ops.Caller, source: str, destination: str) -> ops.Entry:
        sb = self.sandboxes[caller.sandbox_id]
        src, dst = self._abs(caller, source), self._abs(caller, destination)
        if src not in sb.files:
            raise NotFound(f"path '{src}' does not exist")
        sb.files[dst] = sb.files.pop(src)
        self._notify(sb, src, ops.FsEventType.RENAME)
        return self._entry(sb, dst)

    async def remove(self, caller: ops.Caller, path: str) -> None:
        sb = self.sandboxes[caller.sandbox_id]
        full = self._abs(caller, path)
        if sb.files.pop(full, None) is None:
            if full not in sb.dirs:
                raise NotFound(f"path '{full}' does not exist")
            sb.dirs.discard(full)
        self._notify(sb, full, ops.FsEventType.REMOVE)

    async def watch(self, caller: ops.Caller, watch: ops.Watch) -> AsyncIterator[ops.FsEvent]:
        sb = self.sandboxes[caller.sandbox_id]
        full = self._abs(caller, watch.path)
        if full not in sb.dirs:
            raise NotFound(f"path '{full}' does not exist")
        queue: asyncio.Queue[ops.FsEvent] = asyncio.Queue()
        item = (replace(watch, path=full), queue)
        sb.watchers.append(item)

        async def events() -> AsyncIterator[ops.FsEvent]:
            try:
                while True:
                    yield await queue.get()
            finally:
                sb.watchers.remove(item)

        return events()

    async def create_watcher(self, caller: ops.Caller, watch: ops.Watch) -> str:
        sb = self.sandboxes[caller.sandbox_id]
        full = self._abs(caller, watch.path)
        if full not in sb.dirs:
            raise NotFound(f"path '{full}' does not exist")
        watcher_id = f"w{len(sb.polled) + 1}"
        sb.polled[watcher_id] = (replace(watch, path=full), [])
        return watcher_id

    async def watcher_events(self, caller: ops.Caller, watcher_id: str) -> list[ops.FsEvent]:
        sb = self.sandboxes[caller.sandbox_id]
        if watcher_id not in sb.polled:
            raise NotFound(f"watcher {watcher_id} not found")
        watch, events = sb.polled[watcher_id]
        sb.polled[watcher_id] = (watch, [])
        return events

    async def remove_watcher(self, caller: ops.Caller, watcher_id: str) -> None:
        sb = self.sandboxes[caller.sandbox_id]
        if sb.polled.pop(watcher_id, None) is None:
            raise NotFound(f"watcher {watcher_id} not found")

    async def read(self, caller: ops.Caller, path: str) -> AsyncIterator[bytes]:
        sb = self.sandboxes[caller.sandbox_id]
        full = self._abs(caller, path)
        if full in sb.dirs:
            raise InvalidRequest(f"path '{full}' is a directory")
        if full not in sb.files:
            raise NotFound(f"path '{full}' does not exist")
        data = sb.files[full]

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 65536):
                yield data[i : i + 65536]

        return chunks()

    async def write(
        self, caller: ops.Caller, path: str, chunks: AsyncIterator[bytes], metadata: Mapping[str, str]
    ) -> ops.Entry:
        sb = self.sandboxes[caller.sandbox_id]
        full = self._abs(caller, path)
        data = b"".join([c async for c in chunks])
        parent = posixpath.dirname(full)
        parts = parent.split("/")
        for i in range(2, len(parts) + 1):
            sb.dirs.add("/".join(parts[:i]))
        existed = full in sb.files
        sb.files[full] = data
        sb.meta[full] = dict(metadata)
        self._notify(sb, full, ops.FsEventType.WRITE if existed else ops.FsEventType.CREATE)
        return self._entry(sb, full)

    # -- AgentInfoOps ---------------------------------------------------------------------

    async def envs(self, caller: ops.Caller) -> dict[str, str]:
        return dict(self.sandboxes[caller.sandbox_id].env)

    async def agent_metrics(self, caller: ops.Caller) -> ops.AgentMetrics:
        return ops.AgentMetrics(
            int(NOW.timestamp()), 2, 5.0, 512 << 20, 100 << 20, 10 << 20, 1 << 30, 2 << 30
        )

    # -- InterpreterOps -------------------------------------------------------------------

    def execute(
        self,
        caller: ops.Caller,
        code: str,
        *,
        language: str | None,
        context_id: str | None,
        envs: Mapping[str, str],
    ) -> AsyncIterator[ops.CellEvent]:
        sb = self.sandboxes[caller.sandbox_id]
        key = context_id or f"default-{language or 'python'}"
        if context_id is not None and context_id not in sb.contexts:
            raise NotFound(f"context {context_id} not found")

        async def events() -> AsyncIterator[ops.CellEvent]:
            count = sb.counters.get(key, 0) + 1
            sb.counters[key] = count
            if code.startswith("raise "):
                yield ops.CellError("ValueError", code.removeprefix("raise "), "Traceback ...")
            elif code.startswith("print("):
                yield ops.CellOutput("stdout", code[7:-2] + "\n", NOW)
            else:
                yield ops.CellResult(
                    {"text/plain": code, "image/png": "iVBORw0KGgo=", "application/x-x": "1"}, True
                )
            yield ops.CellDone(count)

        return events()

    async def create_context(
        self, caller: ops.Caller, language: str | None, cwd: str | None
    ) -> ops.CodeContext:
        sb = self.sandboxes[caller.sandbox_id]
        ctx = ops.CodeContext(f"ctx-{len(sb.contexts) + 1}", language or "python", cwd or HOME)
        sb.contexts[ctx.context_id] = ctx
        return ctx

    async def list_contexts(self, caller: ops.Caller) -> list[ops.CodeContext]:
        return list(self.sandboxes[caller.sandbox_id].contexts.values())

    async def remove_context(self, caller: ops.Caller, context_id: str) -> None:
        if self.sandboxes[caller.sandbox_id].contexts.pop(context_id, None) is None:
            raise NotFound(f"context {context_id} not found")

    async def restart_context(self, caller: ops.Caller, context_id: str) -> None:
        sb = self.sandboxes[caller.sandbox_id]
        if context_id not in sb.contexts:
            raise NotFound(f"context {context_id} not found")
        sb.counters.pop(context_id, None)


class FakeProcesses:
    """ProcessOps over the same sandboxes (``connect`` is a name SandboxOps uses too)."""

    def __init__(self, pal: FakePal) -> None:
        self.pal = pal

    def _proc(self, caller: ops.Caller, ref: ops.ProcessRef) -> FakeProcess:
        sb = self.pal.sandboxes[caller.sandbox_id]
        for p in sb.processes.values():
            if (ref.pid is not None and p.pid == ref.pid) or (ref.tag is not None and p.spec.tag == ref.tag):
                return p
        raise NotFound(f"process {ref.pid or ref.tag} not found")

    def start(self, caller: ops.Caller, spec: ops.ProcessSpec) -> AsyncIterator[ops.ProcessEvent]:
        sb = self.pal.sandboxes[caller.sandbox_id]
        proc = FakeProcess(next(self.pal.pids), spec, size=spec.pty)
        sb.processes[proc.pid] = proc
        proc.emit(ops.ProcessStarted(proc.pid))
        script = spec.args[-1] if spec.args[:2] == ("-l", "-c") else None
        self._run(sb, caller, proc, script)
        return proc.follow(0)

    def _run(self, sb: FakeSandbox, caller: ops.Caller, proc: FakeProcess, script: str | None) -> None:
        if script is None:  # a shell on a terminal: echoes what it is sent
            return
        word, _, rest = script.partition(" ")
        if word == "echo":
            stream: str = "stderr" if rest.endswith(" >&2") else "stdout"
            text = rest.removesuffix(" >&2")
            proc.emit(ops.ProcessOutput(stream, (text + "\n").encode()))  # type: ignore[arg-type]
            proc.emit(ops.ProcessEnded(0, status="exit status 0"))
        elif word == "exit":
            proc.emit(ops.ProcessEnded(int(rest), status=f"exit status {rest}", error=f"exit status {rest}"))
        elif word == "pwd":
            proc.emit(ops.ProcessOutput("stdout", ((proc.spec.cwd or HOME) + "\n").encode()))
            proc.emit(ops.ProcessEnded(0, status="exit status 0"))
        elif word == "whoami":
            proc.emit(ops.ProcessOutput("stdout", ((caller.user or "user") + "\n").encode()))
            proc.emit(ops.ProcessEnded(0, status="exit status 0"))
        elif word == "env":
            value = {**sb.env, **proc.spec.envs}.get(rest, "")
            proc.emit(ops.ProcessOutput("stdout", (value + "\n").encode()))
            proc.emit(ops.ProcessEnded(0, status="exit status 0"))
        elif word in ("cat", "sleep"):
            if word == "cat" and not proc.spec.stdin:
                proc.emit(ops.ProcessEnded(0, status="exit status 0"))
        else:
            proc.emit(ops.ProcessOutput("stderr", f"bash: {word}: command not found\n".encode()))
            proc.emit(ops.ProcessEnded(127, status="exit status 127", error="exit status 127"))

    def connect(self, caller: ops.Caller, ref: ops.ProcessRef) -> AsyncIterator[ops.ProcessEvent]:
        proc = self._proc(caller, ref)

        async def events() -> AsyncIterator[ops.ProcessEvent]:
            yield ops.ProcessStarted(proc.pid)
            async for event in proc.follow(len(proc.events)):
                yield event

        return events()

    async def list_processes(self, caller: ops.Caller) -> list[ops.ProcessInfo]:
        sb = self.pal.sandboxes[caller.sandbox_id]
        return [
            ops.ProcessInfo(p.pid, p.spec.cmd, p.spec.args, p.spec.envs, p.spec.cwd, p.spec.tag)
            for p in sb.processes.values()
            if not p.ended
        ]

    async def send_input(self, caller: ops.Caller, ref: ops.ProcessRef, data: bytes, pty: bool) -> None:
        proc = self._proc(caller, ref)
        if proc.ended or (not pty and not proc.stdin_open):
            raise Conflict("the process takes no more input")
        proc.emit(ops.ProcessOutput("pty" if pty else "stdout", data))

    async def close_stdin(self, caller: ops.Caller, ref: ops.ProcessRef) -> None:
        proc = self._proc(caller, ref)
        proc.stdin_open = False
        if proc.spec.args[-1:] == ("cat",):
            proc.emit(ops.ProcessEnded(0, status="exit status 0"))

    async def signal(self, caller: ops.Caller, ref: ops.ProcessRef, signal: ops.Signal) -> None:
        proc = self._proc(caller, ref)
        if not proc.ended:
            proc.emit(ops.ProcessEnded(-1, exited=False, status="signal: killed", error="signal: killed"))

    async def resize(self, caller: ops.Caller, ref: ops.ProcessRef, cols: int, rows: int) -> None:
        proc = self._proc(caller, ref)
        if proc.spec.pty is None:
            raise Conflict("the process has no terminal")
        proc.size = (cols, rows)


class FakeInfo:
    """AgentInfoOps (``metrics`` is a name SandboxOps uses too)."""

    def __init__(self, pal: FakePal) -> None:
        self.pal = pal

    async def envs(self, caller: ops.Caller) -> dict[str, str]:
        return await self.pal.envs(caller)

    async def metrics(self, caller: ops.Caller) -> ops.AgentMetrics:
        return await self.pal.agent_metrics(caller)


def backend(pal: FakePal) -> ops.AgentBackend:
    return ops.AgentBackend(
        access=pal.access, processes=FakeProcesses(pal), files=pal, info=FakeInfo(pal), interpreter=pal
    )
