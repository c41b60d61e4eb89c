"""What a caller asks of a sandbox: AgentSpec (schedule), ExecRequest, ProcessStartRequest, ForkRequest,
PauseRequest, the egress policy (also PUT .../egress) and wait management (waitPause).

The bottom of the package's layering (docs/internals.md, "Package layering": types shared
across layers live in the lowest layer that needs them): the API takes these as request
bodies (camelCase on the wire), the scheduler as its domain objects, the runtime manager gets
``ExecRequest`` as is. So validation rules are stated once, here. The only module of ``pal``
it imports are ``pal.sizes`` (the default sizes and their bounds, one layer lower so that the
CLI can show them without these models), ``pal.limits`` (what a spec asks of the host) and
``pal.guest.protocol`` (the limits the guest
enforces too: a process's journal and tag). The egress matcher (pal/network/policy.py)
compiles the entries parsed here.

    egress = "none" | "open" | {"allow": [entry, ...]} | {"deny": [entry, ...]}
    entry  = domain[:port]          pypi.org, *.githubusercontent.com:443 ("*." = any subdomain)
           | ipv4[/len][:port]      140.82.112.3, 10.0.0.0/8, 1.2.3.4:443
           | ipv6[/len] | [ipv6[/len]]:port
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from pal.guest import protocol as P
from pal.limits import DEFAULT_MAX_CONNECTIONS as DEFAULT_MAX_CONNECTIONS
from pal.limits import STRICT, Limits
from pal.volume_spec import MAX_VOLUME_MOUNTS, VolumeMountSpec, check_mounts

IMAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
USER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")

# Request limits (each checked here, so a bad request is a 400 naming the field, never a
# failure deep in the guest or the spawn). Secrets travel in the VM's 64 KiB config drive
# (guest/protocol.encode_config) with its identity: 32 KiB of them, JSON-encoded, fit.
MAX_SECRETS = 64
MAX_SECRET_BYTES = 16 * 1024
MAX_SECRETS_JSON_BYTES = 32 * 1024
# exec: execve's own limits are 128 KiB per string and ~2 MiB for argv + env together.
MAX_ARGS = 4096
MAX_ARG_BYTES = 128 * 1024
MAX_ENV = 1024
MAX_EXEC_STRINGS_BYTES = 1024 * 1024  # argv + env, all strings together
MAX_PATH_CHARS = 4096
MAX_EGRESS_ENTRIES = 256
# metadata (an orchestrator's tags): small, keys safe in a query string (GET /vms?metadata.k=v)
MAX_METADATA_KEYS = 32
METADATA_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,62}$")
MAX_METADATA_VALUE_CHARS = 256
MAX_METADATA_JSON_BYTES = 4096
MAX_LIFETIME_SECS = 30 * 24 * 3600  # lifetimeSecs, counted from the schedule
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_PORTED = re.compile(r"^(?P<host>[^:\[\]]+):(?P<port>[0-9]{1,5})$")
_BRACKETED = re.compile(r"^\[(?P<host>[^\]]+)\](?::(?P<port>[0-9]{1,5}))?$")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class EgressEntry:
    """One parsed entry: a domain (``wildcard``: any subdomain of it) or a network."""

    text: str  # normalised, as shown in events and answers
    port: int | None
    domain: str | None = None
    wildcard: bool = False
    network: Network | None = None


def _port(raw: str, entry: str) -> int:
    port = int(raw)
    if not 1 <= port <= 65535:
        raise ValueError(f"egress entry {entry!r}: port {port} is outside 1-65535")
    return port


def _network(raw: str) -> Network | None:
    try:
        return ipaddress.ip_network(raw, strict=False)
    except ValueError:
        return None


def _domain(raw: str, entry: str) -> tuple[str, bool]:
    name = raw.lower().rstrip(".")
    wildcard = name.startswith("*.")
    if wildcard:
        name = name[2:]
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(
            f"egress entry {entry!r} is not a domain (like pypi.org or *.example.com), "
            "host:port, IP address or CIDR"
        )
    if labels[-1].isdigit():
        raise ValueError(f"egress entry {entry!r} is neither a valid IP address nor a domain")
    return name, wildcard


def parse_entry(entry: str) -> EgressEntry:
    """Parse one allow/deny entry; ValueError names the entry when it is malformed."""
    if not isinstance(entry, str):
        raise ValueError(f"egress entry {entry!r} must be a string")
    raw = entry.strip()
    if not raw or len(raw) > 300:
        raise ValueError(f"egress entry {entry!r} is empty or too long")
    port: int | None = None
    host = raw
    m = _BRACKETED.match(raw)
    if m:
        host = m.group("host")
        if m.group("port"):
            port = _port(m.group("port"), entry)
        net = _network(host)
        if net is None or net.version != 6:
            raise ValueError(f"egress entry {entry!r}: only IPv6 addresses go in brackets")
        return EgressEntry(text=_net_text(net, port), port=port, network=net)
    if raw.count(":") >= 2:  # a bare IPv6 address or network, no port
        net = _network(raw)
        if net is None:
            raise ValueError(f"egress entry {entry!r} is not a valid IPv6 address or network")
        return EgressEntry(text=_net_text(net, None), port=None, network=net)
    m = _PORTED.match(raw)
    if m:
        host, port = m.group("host"), _port(m.group("port"), entry)
    elif ":" in raw:
        raise ValueError(f"egress entry {entry!r}: the port must be a number (host:port)")
    net = _network(host)
    if net is not None:
        return EgressEntry(text=_net_text(net, port), port=port, network=net)
    if re.fullmatch(r"[0-9./]+", host):
        raise ValueError(f"egress entry {entry!r} is not a valid IPv4 address or CIDR")
    name, wildcard = _domain(host, entry)
    shown = ("*." if wildcard else "") + name + (f":{port}" if port else "")
    return EgressEntry(text=shown, port=port, domain=name, wildcard=wildcard)


def _net_text(net: Network, port: int | None) -> str:
    single = net.prefixlen == net.max_prefixlen
    base = str(net.network_address) if single else str(net)
    if port is None:
        return base
    return f"[{base}]:{port}" if net.version == 6 else f"{base}:{port}"


def _entries(value: object) -> list[str]:
    if not isinstance(value, list):
        raise ValueError("must be a list of entries")
    if len(value) > MAX_EGRESS_ENTRIES:
        raise ValueError(f"at most {MAX_EGRESS_ENTRIES} entries, got {len(value)}")
    return [parse_entry(v).text for v in value]


Entries = Annotated[list[str], BeforeValidator(_entries)]


class _Plain(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class EgressAllow(_Plain):
    allow: Entries = Field(description="only these destinations (domains, host:port, IPs, CIDRs)")


class EgressDeny(_Plain):
    deny: Entries = Field(description="everything except these destinations")


EgressMode = Literal["none", "open"]
Egress = EgressMode | EgressAllow | EgressDeny


class EgressUpdate(_Plain):
    """Body of PUT /v1/runtime/vms/{id}/egress: the same shape as AgentSpec.egress."""

    egress: Egress

    @field_validator("egress", mode="before")
    @classmethod
    def _egress(cls, v: object) -> object:
        return coerce_egress(v)


def coerce_egress(v: object) -> object:
    """Validate an egress value up front with one clear message (pydantic's own errors for
    a union list every alternative). Returns the typed value; None passes through."""
    if v is None or isinstance(v, EgressAllow | EgressDeny):
        return v
    if isinstance(v, str):
        if v not in ("none", "open"):
            raise ValueError("egress must be 'none', 'open', {'allow': [...]} or {'deny': [...]}")
        return v
    if not isinstance(v, dict) or len(v) != 1 or next(iter(v)) not in ("allow", "deny"):
        raise ValueError("egress must be 'none', 'open', {'allow': [...]} or {'deny': [...]} (one key)")
    key, entries = next(iter(v.items()))
    normalised = _entries(entries)
    return EgressAllow(allow=normalised) if key == "allow" else EgressDeny(deny=normalised)


def egress_to_json(e: Egress) -> object:
    return e if isinstance(e, str) else e.model_dump()


def egress_from_json(raw: object) -> Egress:
    """A stored or wire policy back into the validated type (ValueError if malformed)."""
    return EgressUpdate.model_validate({"egress": raw}).egress


def parse_egress_default(raw: str | None) -> Egress:
    """PAL_EGRESS_DEFAULT: `open` (the default), `none`, or a JSON allow/deny object."""
    text = (raw or "").strip() or "open"
    if text in ("open", "none"):
        return text  # type: ignore[return-value]
    try:
        return egress_from_json(json.loads(text))
    except ValueError as exc:
        raise ValueError(f"PAL_EGRESS_DEFAULT is not a valid egress policy: {exc}") from exc


class _Model(BaseModel):
    model_config = STRICT


class Placement(_Model):
    """Hard constraints on the node a VM runs on (pal/scheduler/placement.py)."""

    region: str | None = Field(None, max_length=64, description="only nodes of this region")
    labels: dict[str, str] = Field(default_factory=dict, description="only nodes carrying all these labels")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 32 or any(len(k) > 64 or len(x) > 256 for k, x in v.items()):
            raise ValueError("at most 32 labels, keys up to 64 and values up to 256 characters")
        return v


HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")
MAX_BROKERED_HOSTS = 32


def _secret_value(name: str, value: str) -> str:
    if "\0" in value:
        raise ValueError(f"secret {name!r} contains a NUL byte")
    if len(value.encode()) > MAX_SECRET_BYTES:
        raise ValueError(f"secret {name!r} is longer than {MAX_SECRET_BYTES // 1024} KiB")
    return value


class Brokering(_Model):
    """Where the egress gateway puts a brokered secret's real value (docs/secrets.md)."""

    hosts: list[str] = Field(..., description="domains (or *.domain) whose requests get the value")
    header: str | None = Field(None, description="header to set to `format` (else: placeholder substitution)")
    format: str = Field("{value}", description="the header's value; `{value}` is the secret")

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        if not 1 <= len(v) <= MAX_BROKERED_HOSTS:
            raise ValueError(f"hosts must list 1 to {MAX_BROKERED_HOSTS} domains")
        out = []
        for h in v:
            try:
                name, wildcard = _domain(str(h), str(h))
            except ValueError:
                raise ValueError(
                    f"host {h!r} is not a domain (like api.example.com or *.example.com)"
                ) from None
            out.append(("*." if wildcard else "") + name)
        return out

    @field_validator("header")
    @classmethod
    def _header(cls, v: str | None) -> str | None:
        if v is not None and not HEADER_NAME.match(v):
            raise ValueError(f"header {v!r} is not an HTTP header name")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        if "{value}" not in v or len(v) > 1024 or any(c in v for c in "\r\n\0"):
            raise ValueError("format must contain {value}, on one line, at most 1 KiB")
        return v


class BrokeredSecret(_Model):
    """A secret the guest never sees: it holds a placeholder, and the egress gateway puts
    the value into requests to ``brokered.hosts`` only."""

    value: str = Field(..., min_length=1, description="the real value (never enters the VM)")
    brokered: Brokering

    @field_validator("value")
    @classmethod
    def _value(cls, v: str) -> str:
        if any(c in v for c in "\r\n\0"):
            raise ValueError("a brokered value goes into an HTTP header: no CR, LF or NUL")
        return _secret_value("value", v)


def _secret_objects(v: object) -> object:
    """One clear message per bad secret (pydantic's own for a union lists both shapes)."""
    if not isinstance(v, dict):
        return v
    out: dict[object, object] = {}
    for k, val in v.items():
        if isinstance(val, dict):
            try:
                val = BrokeredSecret.model_validate(val)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(x) for x in first.get("loc", ()))
                msg = str(first["msg"]).removeprefix("Value error, ")
                raise ValueError(f"secret {k!r}: {where + ': ' if where else ''}{msg}") from None
        elif not isinstance(val, str | BrokeredSecret):
            raise ValueError(f"secret {k!r} must be a string or {{value, brokered}}")
        out[k] = val
    return out


def _secret_rules(v: dict[str, str | BrokeredSecret]) -> dict[str, str | BrokeredSecret]:
    if len(v) > MAX_SECRETS:
        raise ValueError(f"at most {MAX_SECRETS} secrets")
    for k, val in v.items():
        if not ENV_NAME.match(k):
            raise ValueError(f"secret name {k[:64]!r} is not a valid environment variable name")
        if isinstance(val, str):
            _secret_value(k, val)
    total = len(json.dumps({k: val if isinstance(val, str) else val.value for k, val in v.items()}))
    if total > MAX_SECRETS_JSON_BYTES:
        raise ValueError(f"secrets take {total} bytes as JSON; at most {MAX_SECRETS_JSON_BYTES // 1024} KiB")
    return v


# The one rule for a VM's secrets: a schedule's, a fork's, a start's from a kept snapshot.
Secrets = Annotated[
    dict[str, str | BrokeredSecret], BeforeValidator(_secret_objects), AfterValidator(_secret_rules)
]
_SECRETS: TypeAdapter[dict[str, str | BrokeredSecret]] = TypeAdapter(Secrets)


def check_secrets(v: object) -> dict[str, str | BrokeredSecret]:
    """``v`` by the rule of ``Secrets``; ValueError with the first problem."""
    try:
        return _SECRETS.validate_python(v, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(str(first["msg"]).removeprefix("Value error, ")) from None


class SecretUpdate(_Model):
    """Body of PUT /v1/runtime/vms/{id}/secrets/{name}: a brokered secret's new value."""

    value: str = Field(..., min_length=1)

    @field_validator("value")
    @classmethod
    def _value(cls, v: str) -> str:
        return BrokeredSecret._value(v)  # type: ignore[no-any-return]


DEFAULT_HOLD_BUFFER = 16 * 1024 * 1024  # waitPause.maxBufferBytes when a spec does not say


class WaitPause(_Model):
    """Automatic wait management (docs/live-pause.md): live-pause the VM while its guest is
    idle and waits on a connection the egress gateway holds; wake it when data is ready."""

    after_ms: int = Field(
        500, ge=50, le=3_600_000, description="the guest idle this long (and waiting) before a pause"
    )
    offload_after_ms: int | None = Field(
        5000, ge=0, le=86_400_000, description="offload the paused VM's RAM after this long (null: never)"
    )
    deliver: Literal["first-byte", "complete"] = Field(
        "first-byte",
        description="wake at the first response byte, or once the response is complete "
        "(the upstream closed, maxBufferBytes reached, or 200 ms without a new byte)",
    )
    max_buffer_bytes: int = Field(
        DEFAULT_HOLD_BUFFER,
        ge=64 * 1024,
        le=256 * 1024 * 1024,
        description="response bytes the host buffers while the VM is paused; then TCP backpressure",
    )


def parse_wait_pause_default(raw: str | None) -> WaitPause | None:
    """PAL_WAIT_PAUSE: unset/`off` (no wait management unless a spec asks), `on` (the
    defaults) or a JSON waitPause object."""
    text = (raw or "").strip()
    if text.lower() in ("", "off", "0", "false", "no"):
        return None
    if text.lower() in ("on", "1", "true", "yes"):
        return WaitPause.model_validate({})
    try:
        return WaitPause.model_validate(json.loads(text))
    except ValueError as exc:
        raise ValueError(f"PAL_WAIT_PAUSE is not `on`, `off` or a waitPause object: {exc}") from exc


LifetimeEnd = Literal["pause", "delete"]


def check_metadata(v: object) -> dict[str, str]:
    """The one check of a VM's metadata: string keys and values within the bounds above."""
    if not isinstance(v, dict):
        raise ValueError("metadata must be an object of string values")
    if len(v) > MAX_METADATA_KEYS:
        raise ValueError(f"metadata has {len(v)} keys; at most {MAX_METADATA_KEYS}")
    key_rule = "1-63 of A-Z a-z 0-9 _ . : / - (first: no . : / -)"
    for k, val in v.items():
        if not isinstance(k, str) or not METADATA_KEY.match(k):
            raise ValueError(f"metadata key {str(k)[:64]!r}: {key_rule}")
        if not isinstance(val, str) or len(val) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata value of {k!r}: a string of at most {MAX_METADATA_VALUE_CHARS} chars")
    size = len(json.dumps(v, ensure_ascii=False).encode())
    if size > MAX_METADATA_JSON_BYTES:
        raise ValueError(f"metadata takes {size} bytes as JSON; at most {MAX_METADATA_JSON_BYTES}")
    return dict(v)


Metadata = Annotated[dict[str, str], BeforeValidator(check_metadata)]


class AgentSpec(_Model):
    image: str = Field("default", description="guest image name (GET /v1/images lists them)")
    isolation: str = Field("microvm", description="isolation kind; only `microvm` exists")
    limits: Limits = Field(default_factory=Limits)  # type: ignore[arg-type]
    egress: Egress | None = Field(
        None,
        description='`"none"`, `"open"`, `{"allow": [...]}` or `{"deny": [...]}` (entries: domains, '
        "`*.domain`, host:port, IPs, CIDRs); default PAL_EGRESS_DEFAULT (open)",
    )
    secrets: Secrets = Field(
        default_factory=dict,
        description="env vars for every exec; an object `{value, brokered: {hosts, header, format}}` "
        "is brokered: the guest sees a placeholder, the egress gateway inserts the value",
    )
    idle_timeout_secs: int = Field(0, ge=0, le=7 * 24 * 3600, description="0 = never suspend")
    idle_live_pause_secs: int = Field(
        0,
        ge=0,
        le=7 * 24 * 3600,
        description="first idle tier: live-pause and offload after this many idle seconds (the QEMU and "
        "its warm state stay; a wake is transparent); idleTimeoutSecs then snapshot-pauses it. 0 = off",
    )
    wait_pause: WaitPause | Literal[False] | None = Field(
        None,
        description="automatic wait management; null: the server default (PAL_WAIT_PAUSE), false: off",
    )
    boot: str = Field("auto", description="`auto` (warm template when one fits) or `cold`")
    placement: Placement = Field(default_factory=Placement)  # type: ignore[arg-type]
    metadata: Metadata = Field(default_factory=dict, description="your tags; forks inherit them (README)")
    lifetime_secs: int = Field(
        0, ge=0, le=MAX_LIFETIME_SECS, description="end it this long after its schedule; 0 = never"
    )
    on_lifetime_end: LifetimeEnd = Field("delete", description="what its lifetime's end does")
    volumes: list[VolumeMountSpec] = Field(
        default_factory=list,
        max_length=MAX_VOLUME_MOUNTS,
        description="the tenant's volumes to mount, `[{name, path, readOnly}]` (docs/volumes.md)",
    )

    _volumes = field_validator("volumes")(check_mounts)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not IMAGE_NAME.match(v):
            raise ValueError("image must be a lowercase name like 'default'")
        return v

    @field_validator("isolation")
    @classmethod
    def _isolation(cls, v: str) -> str:
        if v != "microvm":
            raise ValueError("isolation must be 'microvm'")
        return v

    @field_validator("egress", mode="before")
    @classmethod
    def _egress(cls, v: object) -> object:
        return coerce_egress(v)

    @field_validator("wait_pause", mode="before")
    @classmethod
    def _wait_pause_false_is_false(cls, v: object) -> object:
        # Literal[False] alone would take 0 (0 == False), which the schema does not allow.
        if isinstance(v, int) and not isinstance(v, bool):
            raise ValueError("waitPause must be an object, false or null")
        return v

    @field_validator("boot")
    @classmethod
    def _boot(cls, v: str) -> str:
        if v not in ("auto", "cold"):
            raise ValueError("boot must be 'auto' or 'cold'")
        return v

    @model_validator(mode="after")
    def _tiers(self) -> AgentSpec:
        if (
            self.idle_live_pause_secs
            and self.idle_timeout_secs
            and (self.idle_live_pause_secs >= self.idle_timeout_secs)
        ):
            raise ValueError(
                "idleLivePauseSecs must be shorter than idleTimeoutSecs (the live tier comes first)"
            )
        return self


MAX_EXEC_TIMEOUT_S = 24 * 3600  # the ceiling of an exec's timeoutSecs (and of the default)


MAX_YIELD_AFTER_MS = 60_000  # the longest an exec may wait before it yields


class ExecRequest(_Model):
    command: str = Field(
        ..., min_length=1, max_length=MAX_PATH_CHARS, description="executable (path or name)"
    )
    argv: list[str] = Field(
        default_factory=list, max_length=MAX_ARGS, description="arguments, without argv[0]"
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENV)
    cwd: str | None = Field(
        None, max_length=MAX_PATH_CHARS, description="working directory, default /workspace"
    )
    timeout_secs: float | None = Field(
        None,
        gt=0,
        le=MAX_EXEC_TIMEOUT_S,
        description="kill the command after this long (`exitCode: 124, timedOut: true`); "
        "a buffered exec without it gets the server's default (PAL_EXEC_DEFAULT_TIMEOUT, 300 s)",
    )
    user: str | None = Field(
        None,
        description="`pal` (default: the image's workload user, whatever its name), `root`, "
        "or the workload user's own name (an image's USER)",
    )
    yield_after_ms: int | None = Field(
        None,
        ge=0,
        le=MAX_YIELD_AFTER_MS,
        description="buffered exec only: the whole result if the command ends within this "
        "long, else `{processId, running: true}` with the output so far and the offset to read "
        "on from (`/processes/{processId}/output`); the command keeps running (docs/processes.md)",
    )
    # Set by the API for an SSE exec, never in the public schema: a client that drops the
    # stream leaves the command running, to be read on through /processes/{id}/output.
    detach_on_close: SkipJsonSchema[bool] = False

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not ENV_NAME.match(k):
                raise ValueError(f"env name {k[:64]!r} is not a valid environment variable name")
            if "\0" in val or len(val.encode()) > MAX_ARG_BYTES:
                raise ValueError(f"env {k!r}: at most {MAX_ARG_BYTES // 1024} KiB and no NUL byte")
        return v

    @field_validator("command", "cwd")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\0" in v:
            raise ValueError("must not contain a NUL byte")
        return v

    @field_validator("argv")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        for i, a in enumerate(v):
            if "\0" in a or len(a.encode()) > MAX_ARG_BYTES:
                raise ValueError(f"argument {i}: at most {MAX_ARG_BYTES // 1024} KiB and no NUL byte")
        return v

    @model_validator(mode="after")
    def _total(self) -> ExecRequest:
        total = sum(len(a.encode()) for a in (self.command, *self.argv))
        total += sum(len(k) + len(val.encode()) + 2 for k, val in self.env.items())
        if total > MAX_EXEC_STRINGS_BYTES:
            raise ValueError(f"argv and env take {total} bytes; at most {MAX_EXEC_STRINGS_BYTES // 1024} KiB")
        return self

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        # Which names exist is the guest's to say (an image's USER): it answers 400 for others.
        if v is not None and not USER_NAME.match(v):
            raise ValueError("user must be a user name: 'pal', 'root' or the image's user")
        return v


class PauseRequest(_Model):
    """Body of POST .../pause (optional: no body is a snapshot pause)."""

    mode: Literal["snapshot", "live"] = Field(
        "snapshot",
        description="`snapshot`: memory and disk to a snapshot, the QEMU stops, the slot is freed; "
        "`live`: the vCPUs stop in place (same QEMU, connections kept, slot kept)",
    )
    offload: bool = Field(False, description="live only: also hand the guest's RAM back to the host")

    @model_validator(mode="after")
    def _offload_live(self) -> PauseRequest:
        if self.offload and self.mode != "live":
            raise ValueError("offload needs mode 'live'")
        return self


class LifetimeUpdate(_Model):
    """PUT .../lifetime: ``lifetimeSecs`` (from the schedule; 0 = none) or ``extendSecs``."""

    lifetime_secs: int | None = Field(None, ge=0, le=MAX_LIFETIME_SECS)
    extend_secs: int | None = Field(None, ge=1, le=MAX_LIFETIME_SECS)
    on_lifetime_end: LifetimeEnd | None = None

    @model_validator(mode="after")
    def _one(self) -> LifetimeUpdate:
        if (self.lifetime_secs is None) == (self.extend_secs is None):
            raise ValueError("give exactly one of lifetimeSecs and extendSecs")
        return self


class ForkRequest(_Model):
    count: int = Field(..., description="number of children, 1..PAL_MAX_FORK_COUNT")
    metadata: Metadata | None = Field(None, description="each child's tags instead of the source's")
    secrets: Secrets | None = Field(None, description="env vars set over the source's in each child")


class Terminal(_Model):
    """A process's terminal (PTY): its size in characters."""

    cols: int = Field(80, ge=1, le=1000)
    rows: int = Field(24, ge=1, le=1000)


class ProcessStartRequest(ExecRequest):
    """Body of POST .../processes: an exec request, plus what a process that outlives its
    request needs (docs/processes.md)."""

    detach_on_close: SkipJsonSchema[Literal[False]] = False  # exec's: a process never dies with a stream
    stdin: bool = Field(False, description="keep a stdin pipe open for POST .../stdin")
    pty: Terminal | None = Field(None, description="run on a terminal of this size (stdin included)")
    tag: str = Field("", max_length=P.MAX_TAG_CHARS, description="free text to find the process by")
    keep_awake: bool = Field(
        False,
        description="while it runs, the guest reports the VM active (a guest's claim: it delays "
        "an idle suspend by at most one idle timeout; docs/processes.md)",
    )
    journal_bytes: int = Field(
        P.JOURNAL_DEFAULT_BYTES,
        ge=P.JOURNAL_MIN_BYTES,
        le=P.JOURNAL_MAX_BYTES,
        description="output kept for readers; past it the oldest goes and a reader sees a gap",
    )

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError("must not contain a NUL byte")
        return v

    @model_validator(mode="after")
    def _no_yield(self) -> ProcessStartRequest:
        if self.yield_after_ms is not None:
            raise ValueError("yieldAfterMs is for exec; a process runs on by itself")
        return self


class SignalRequest(_Model):
    signal: Literal["INT", "TERM", "KILL", "HUP", "QUIT", "USR1", "USR2", "STOP", "CONT", "WINCH"] = Field(
        ..., description="sent to the process's whole group"
    )
