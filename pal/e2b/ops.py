"""What the E2B surface needs from Pal: the operations, as Protocols, and their values.

`pal/e2b` translates E2B's protocol (REST, Connect-RPC, envd's HTTP, the code
interpreter's NDJSON) onto these operations and owns no lifecycle logic and no state of
its own. binding.py binds each Protocol to Pal's typed operations (the scheduler's
schedule, pause/resume, fork, delete, lifetimes, processes, files, code contexts); the
protocol tests bind them to a fake.

Every operation raises :class:`pal.errors.PalError` (its subclasses) for what went wrong,
with the status Pal's own API would answer: ``errors.py`` turns that into E2B's REST error,
envd's HTTP error or a Connect code. Tenant-scoped calls take the tenant id the caller's
key authenticated; another tenant's sandbox is :class:`pal.errors.NotFound`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Generic, Literal, Protocol, TypeVar

SandboxState = Literal["running", "paused"]
T = TypeVar("T")


# -- control plane (the REST API) ---------------------------------------------------------


@dataclass(frozen=True)
class NetworkPolicy:
    """E2B's network options on create or update, as Pal's egress policy takes them.
    ``allow_internet``: False is E2B's ``allow_internet_access: false`` (deny everything
    not allowed); ``allow_out``/``deny_out``: CIDRs, addresses or domain names."""

    allow_internet: bool = True
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    allow_public_traffic: bool = True


@dataclass(frozen=True)
class VolumeMount:
    """E2B's ``SandboxVolumeMount``: the tenant's volume ``name`` at ``path`` in the sandbox."""

    name: str
    path: str


@dataclass(frozen=True)
class CreateSandbox:
    """``POST /sandboxes``. ``timeout_s``: the sandbox's lifetime from now; at its end it
    is killed, or paused when ``auto_pause`` (``auto_resume``: a paused one wakes on the
    next request). ``secure``: agent calls need the access token minted now."""

    template: str
    timeout_s: int
    metadata: Mapping[str, str] = field(default_factory=dict)
    env_vars: Mapping[str, str] = field(default_factory=dict)
    secure: bool = True
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    network: NetworkPolicy = NetworkPolicy()
    volume_mounts: tuple[VolumeMount, ...] = ()  # the tenant's volumes, by name


@dataclass(frozen=True)
class Sandbox:
    """A sandbox as the E2B surface shows it (one of the tenant's VMs)."""

    sandbox_id: str
    template_id: str
    alias: str | None
    state: SandboxState
    started_at: datetime
    end_at: datetime
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    metadata: Mapping[str, str]
    access_token: str | None  # the envd access token of a secure sandbox
    auto_pause: bool = False
    auto_resume: bool = False
    allow_internet: bool | None = None
    volume_mounts: tuple[VolumeMount, ...] = ()


@dataclass(frozen=True)
class SandboxQuery:
    """``GET /v2/sandboxes``: ``states`` empty means both; ``metadata`` every pair must
    match; ``order`` by start time; ``limit`` at most 100 a page."""

    states: tuple[SandboxState, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    started_after: datetime | None = None
    template: str | None = None
    order: Literal["asc", "desc"] = "desc"
    limit: int = 100
    next_token: str | None = None


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list; ``next_token`` None on the last one."""

    items: list[T]
    next_token: str | None = None


@dataclass(frozen=True)
class ForkOutcome:
    """One requested fork: the sandbox it made, or why it failed (its status and message)."""

    sandbox: Sandbox | None = None
    error_status: int | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class MetricSample:
    """One sample of ``GET /sandboxes/{id}/metrics`` (bytes, percent, unix seconds)."""

    timestamp: datetime
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


@dataclass(frozen=True)
class LogEntry:
    timestamp: datetime
    level: Literal["debug", "info", "warn", "error"]
    message: str
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    snapshot_id: str
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Template:
    """A template: one of the images the tenant may use (``base``: Pal's default image
    with E2B's conventions)."""

    template_id: str
    aliases: tuple[str, ...]
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    created_at: datetime
    public: bool = False


class SandboxOps(Protocol):
    """The control plane's operations the REST API calls (all scoped by ``tenant``)."""

    async def create(self, tenant: str, spec: CreateSandbox) -> Sandbox:
        """Schedule a sandbox of ``spec.template`` with the lifetime, metadata and env;
        404 for a template the tenant has none of, 402 at its quota."""
        ...

    async def get(self, tenant: str, sandbox_id: str) -> Sandbox: ...

    async def list_sandboxes(self, tenant: str, query: SandboxQuery) -> Page[Sandbox]: ...

    async def kill(self, tenant: str, sandbox_id: str) -> None: ...

    async def set_timeout(self, tenant: str, sandbox_id: str, timeout_s: int) -> None:
        """The sandbox's lifetime ends ``timeout_s`` from now (replacing the old end)."""
        ...

    async def pause(self, tenant: str, sandbox_id: str, keep_memory: bool) -> None:
        """409 when it is already paused."""
        ...

    async def connect(self, tenant: str, sandbox_id: str, timeout_s: int) -> tuple[Sandbox, bool]:
        """The sandbox running (resumed if paused: the bool says so), its lifetime at least
        ``timeout_s`` from now (never shortened)."""
        ...

    async def fork(self, tenant: str, sandbox_id: str, count: int, timeout_s: int) -> list[ForkOutcome]: ...

    async def metrics(
        self, tenant: str, sandbox_id: str, start: datetime | None, end: datetime | None
    ) -> list[MetricSample]: ...

    async def logs(
        self, tenant: str, sandbox_id: str, since: datetime | None, limit: int
    ) -> list[LogEntry]: ...

    async def update_network(self, tenant: str, sandbox_id: str, network: NetworkPolicy) -> None: ...

    async def create_snapshot(self, tenant: str, sandbox_id: str, name: str | None) -> Snapshot: ...

    async def list_snapshots(
        self, tenant: str, sandbox_id: str | None, name: str | None, limit: int, next_token: str | None
    ) -> Page[Snapshot]: ...

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None: ...

    async def templates(self, tenant: str) -> list[Template]: ...


class KeyCheck(Protocol):
    """The tenant an E2B API key (``X-API-KEY``) authenticates, or why none."""

    async def __call__(self, api_key: str, /) -> tuple[str | None, str | None]: ...


# -- the agent (envd and the code interpreter) --------------------------------------------


@dataclass(frozen=True)
class SandboxAccess:
    """Who a sandbox's agent calls act for, found by its id alone (agent calls carry no
    tenant key): its tenant, its access token when it is secure, and whether it runs.
    A sandbox that is gone (or never was) is None."""

    tenant: str
    sandbox_id: str
    access_token: str | None
    running: bool


class AccessLookup(Protocol):
    async def __call__(self, sandbox_id: str, /) -> SandboxAccess | None: ...


@dataclass(frozen=True)
class Caller:
    """An agent call: which sandbox, and the user it acts as (None: the default user)."""

    tenant: str
    sandbox_id: str
    user: str | None = None


class FileType(Enum):
    FILE = "file"
    DIRECTORY = "dir"
    SYMLINK = "symlink"


@dataclass(frozen=True)
class Entry:
    """A file system entry, as ``Stat``/``ListDir``/``/files`` show it."""

    name: str
    path: str
    type: FileType
    size: int = 0
    mode: int = 0
    permissions: str = ""
    owner: str = ""
    group: str = ""
    modified_time: datetime | None = None
    symlink_target: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


class FsEventType(Enum):
    CREATE = 1
    WRITE = 2
    REMOVE = 3
    RENAME = 4
    CHMOD = 5


@dataclass(frozen=True)
class FsEvent:
    name: str  # relative to the watched directory
    type: FsEventType
    entry: Entry | None = None


@dataclass(frozen=True)
class Watch:
    path: str
    recursive: bool = False
    include_entry: bool = False


@dataclass(frozen=True)
class ProcessSpec:
    """``Process/Start``: ``cmd`` and ``args`` are run as given (the SDKs send
    ``/bin/bash -l -c <command>``); ``pty`` (cols, rows) gives it a terminal; ``stdin``
    False closes its input at once."""

    cmd: str
    args: tuple[str, ...] = ()
    envs: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    tag: str | None = None
    pty: tuple[int, int] | None = None
    stdin: bool = True


@dataclass(frozen=True)
class ProcessRef:
    """A process named by its pid or its tag (``ProcessSelector``)."""

    pid: int | None = None
    tag: str | None = None


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    cmd: str
    args: tuple[str, ...]
    envs: Mapping[str, str]
    cwd: str | None
    tag: str | None


@dataclass(frozen=True)
class ProcessStarted:
    pid: int


@dataclass(frozen=True)
class ProcessOutput:
    stream: Literal["stdout", "stderr", "pty"]
    data: bytes


@dataclass(frozen=True)
class ProcessEnded:
    exit_code: int
    exited: bool = True  # False: killed by a signal
    status: str = ""  # "exit status 1", "signal: killed", ...
    error: str | None = None


ProcessEvent = ProcessStarted | ProcessOutput | ProcessEnded
Signal = Literal["SIGKILL", "SIGTERM"]


class ProcessOps(Protocol):
    """Processes in a sandbox (Pal's processes and their journals)."""

    def start(self, caller: Caller, spec: ProcessSpec) -> AsyncIterator[ProcessEvent]:
        """The process's events: ProcessStarted first, output, then ProcessEnded. Closing
        the iterator early leaves the process running (only a signal ends it)."""
        ...

    def connect(self, caller: Caller, ref: ProcessRef) -> AsyncIterator[ProcessEvent]:
        """A running process's events from now on (ProcessStarted first, naming its pid);
        404 for no such process."""
        ...

    async def list_processes(self, caller: Caller) -> list[ProcessInfo]: ...

    async def send_input(self, caller: Caller, ref: ProcessRef, data: bytes, pty: bool) -> None: ...

    async def close_stdin(self, caller: Caller, ref: ProcessRef) -> None: ...

    async def signal(self, caller: Caller, ref: ProcessRef, signal: Signal) -> None: ...

    async def resize(self, caller: Caller, ref: ProcessRef, cols: int, rows: int) -> None: ...


class FilesystemOps(Protocol):
    """Files in a sandbox, as the sandbox's user (``caller.user``; paths relative to its
    home). 404 for a missing path, 409 ``ALREADY_EXISTS`` for a directory already there."""

    async def stat(self, caller: Caller, path: str) -> Entry: ...

    async def list_dir(self, caller: Caller, path: str, depth: int) -> list[Entry]: ...

    async def make_dir(self, caller: Caller, path: str) -> Entry: ...

    async def move(self, caller: Caller, source: str, destination: str) -> Entry: ...

    async def remove(self, caller: Caller, path: str) -> None: ...

    async def watch(self, caller: Caller, watch: Watch) -> AsyncIterator[FsEvent]:
        """Put a watch on the directory (404 when it is missing) and give its events from
        now on; closing the iterator removes the watch."""
        ...

    async def create_watcher(self, caller: Caller, watch: Watch) -> str: ...

    async def watcher_events(self, caller: Caller, watcher_id: str) -> list[FsEvent]: ...

    async def remove_watcher(self, caller: Caller, watcher_id: str) -> None: ...

    async def read(self, caller: Caller, path: str) -> AsyncIterator[bytes]:
        """Open the file (404 missing, 400 a directory) and give its bytes in chunks."""
        ...

    async def write(
        self, caller: Caller, path: str, chunks: AsyncIterator[bytes], metadata: Mapping[str, str]
    ) -> Entry:
        """Create or replace the file (and its missing parent directories) with the bytes
        of ``chunks``; its metadata replaced by ``metadata``."""
        ...


@dataclass(frozen=True)
class AgentMetrics:
    """``GET /metrics`` of envd: the sandbox's usage now."""

    ts: int
    cpu_count: int
    cpu_used_pct: float
    mem_total: int
    mem_used: int
    mem_cache: int
    disk_used: int
    disk_total: int


class AgentInfoOps(Protocol):
    async def envs(self, caller: Caller) -> dict[str, str]:
        """The environment commands get by default."""
        ...

    async def metrics(self, caller: Caller) -> AgentMetrics: ...


@dataclass(frozen=True)
class CodeContext:
    context_id: str
    language: str
    cwd: str


@dataclass(frozen=True)
class CellOutput:
    stream: Literal["stdout", "stderr"]
    text: str
    timestamp: datetime


@dataclass(frozen=True)
class CellResult:
    """A result's MIME bundle: ``data`` maps a MIME type (or E2B's key: ``text``,
    ``html``, ``png``, ``chart``, ...) to its value."""

    data: Mapping[str, object]
    is_main_result: bool = False


@dataclass(frozen=True)
class CellError:
    name: str
    value: str
    traceback: str


@dataclass(frozen=True)
class CellDone:
    execution_count: int


CellEvent = CellOutput | CellResult | CellError | CellDone


class InterpreterOps(Protocol):
    """Code cells in a sandbox (Pal's code contexts and their kernels)."""

    def execute(
        self,
        caller: Caller,
        code: str,
        *,
        language: str | None,
        context_id: str | None,
        envs: Mapping[str, str],
    ) -> AsyncIterator[CellEvent]:
        """The cell's events; CellDone last. 404 for an unknown context."""
        ...

    async def create_context(self, caller: Caller, language: str | None, cwd: str | None) -> CodeContext: ...

    async def list_contexts(self, caller: Caller) -> list[CodeContext]: ...

    async def remove_context(self, caller: Caller, context_id: str) -> None: ...

    async def restart_context(self, caller: Caller, context_id: str) -> None: ...


@dataclass(frozen=True)
class AgentBackend:
    """Everything the agent listener calls, bound once in the composition root."""

    access: AccessLookup
    processes: ProcessOps
    files: FilesystemOps
    info: AgentInfoOps
    interpreter: InterpreterOps


# -- the tenant's E2B keys (``/api-keys``: what `pal e2b env` makes its key with) ----------


@dataclass(frozen=True)
class ApiKey:
    """One of the tenant's E2B keys (``key`` only when it was just made: shown once)."""

    key_id: str
    name: str
    mask: str
    created_at: datetime
    key: str | None = None


class KeyOps(Protocol):
    async def create_key(self, tenant: str, name: str) -> ApiKey: ...

    async def list_keys(self, tenant: str) -> list[ApiKey]: ...

    async def revoke_key(self, tenant: str, key_id: str) -> None:
        """404 when the tenant has no key of that id."""
        ...
