"""How pal/config.py's declarations meet the environment: the ``Env`` of each setting (its
variable, meaning, reader and bounds), the pydantic-settings source that reads them, and
README's Configuration table made from them (``python -m pal.config --markdown``)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from pal import sizes
from pal.spec import IMAGE_NAME

Reader = Callable[[str, str], Any]  # (variable name, raw value) -> the setting's value


@dataclass(frozen=True)
class Env:
    """A setting's variable and meaning (README's table), how its value is read (None: by the
    field's type) and its bounds: a value outside [lo, hi] is clamped to them."""

    name: str
    doc: str
    read: Reader | None = None
    lo: float | None = None
    hi: float | None = None
    shown: str | None = None  # the default as README shows it, where the field's is not it


def setting(
    default: Any,
    name: str,
    doc: str,
    *,
    read: Reader | None = None,
    lo: float | None = None,
    hi: float | None = None,
    shown: str | None = None,
) -> Any:
    """One setting's whole declaration: ``field: type = setting(default, "PAL_X", "doc")``."""
    if isinstance(default, list | dict):
        assert not default, "a list or dict setting starts empty"
        empty: Callable[[], Any] = type(default)
        info: FieldInfo = Field(default_factory=empty)
    else:
        info = Field(default)
    info.metadata.append(Env(name, doc, read, lo, hi, shown))
    return info


def env_of(field: FieldInfo) -> Env:
    found = [m for m in field.metadata if isinstance(m, Env)]
    if not found:
        raise TypeError("every Settings field declares its Env")
    return found[0]


# -- readers: each names its variable in its error --


def read_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc


def read_float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {raw!r}") from exc


def read_list(_name: str, raw: str) -> list[str]:
    return [x.strip() for x in raw.split(",") if x.strip()]


def read_switch(on_word: str) -> Reader:
    """A feature on unless turned off: ``on_word``/on/1/yes/true, or off/0/no/false."""

    def read(name: str, raw: str) -> bool:
        value = raw.strip().lower()
        if value in (on_word, "on", "1", "yes", "true"):
            return True
        if value in ("off", "0", "no", "false"):
            return False
        raise ValueError(f"{name} must be '{on_word}' or 'off', got {value!r}")

    return read


def read_egress_dns(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("host", "static"):
        raise ValueError(f"{name} must be 'host' or 'static', got {value!r}")
    return value == "host"


def read_s3_sse(name: str, raw: str, modes: tuple[str, ...]) -> str | None:
    value = raw.strip()
    if value in ("off", "none"):
        return None
    if value not in modes:
        raise ValueError(f"{name} must be one of {', '.join(modes)} or off, got {value!r}")
    return value


def read_max_fork_count(name: str, raw: str) -> int:
    count = read_int(name, raw)
    if count < 1:
        raise ValueError(f"{name} must be at least 1")
    return count


def read_exec_default_timeout(name: str, raw: str) -> float | None:
    secs = read_float(name, raw)
    if secs < 0:
        raise ValueError(f"{name} must be 0 (no default) or more")
    return secs or None


E2B_IDLE_DOC = (
    "seconds an E2B sandbox may sit idle before Pal's idle suspend pauses it (it wakes on the"
    " SDK's next call, and E2B still sees it running: docs/e2b.md); 0: never"
)
E2B_PORT_DOC = (
    "the E2B agent listener of `pal up` (docs/e2b.md): every sandbox's envd and code"
    " interpreter for E2B's SDKs (`E2B_SANDBOX_URL`), on the API's address; `0` turns it off"
)


def read_e2b_port(name: str, raw: str) -> int:
    port = read_int(name, raw)
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port (1-65535), or 0 for none, got {port}")
    return port


def read_ports_port(name: str, raw: str) -> int:
    port = read_int(name, raw)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port (1-65535), got {port}")
    return port


def parse_labels(raw: str | list[str]) -> dict[str, str]:
    """``"k=v,k2=v2"`` (or a list of ``k=v``) as a dict; ValueError on a malformed item."""
    items = raw if isinstance(raw, list) else [x for x in raw.split(",")]
    out: dict[str, str] = {}
    for item in (x.strip() for x in items):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def parse_template_sizes(raw: str | None) -> tuple[str, ...] | None:
    """PAL_TEMPLATE_SIZES: ``256m-1c-2048d,512m-1c-2048d`` (None = any size: ``*``);
    unset or empty: the defaults of pal/sizes.py."""
    text = (raw or "").strip()
    if not text:
        return sizes.DEFAULT_TEMPLATE_SIZES
    if text == "*":
        return None
    out = []
    for item in (x.strip() for x in text.split(",")):
        if item:
            try:
                out.append(sizes.size_name(*sizes.parse_size_name(item)))
            except ValueError as exc:
                raise ValueError(f"PAL_TEMPLATE_SIZES: {exc}") from exc
    return tuple(out)


def parse_pool(
    raw: str | None, default: tuple[tuple[str, int], ...] = sizes.DEFAULT_POOL, env: str = "PAL_POOL"
) -> tuple[tuple[str, int], ...]:
    """PAL_POOL: ``256m-1c-2048d:2,code-interpreter@512m-1c-2048d:1`` (an optional image and
    ``@``, a size, and how many pooled VMs of it; no image: the default one); ``0``/``off``:
    none; unset or empty: ``default`` (pal/sizes.py). Keys: sizes.pool_entry. PAL_PRESTART
    has the same form without images (a waiting QEMU has no image until a restore fills it)."""
    text = (raw or "").strip()
    if not text:
        return default
    if text.lower() in ("0", "off", "false", "no"):
        return ()
    out: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        image, at, size_text = name.strip().rpartition("@")
        if at and env != "PAL_POOL":
            raise ValueError(f"{env}: {item!r}: sizes only, no image")
        image = image if at else sizes.POOL_DEFAULT_IMAGE
        if not IMAGE_NAME.match(image):
            raise ValueError(f"{env}: {item!r}: {image!r} is not an image name")
        try:
            size = sizes.size_name(*sizes.parse_size_name(size_text))
            n = int(count) if count else 1
        except ValueError as exc:
            raise ValueError(f"{env}: {exc}") from exc
        if not 0 <= n <= sizes.POOL_COUNT_MAX:
            raise ValueError(f"{env}: {item!r}: a count is 0..{sizes.POOL_COUNT_MAX}")
        out[sizes.pool_entry(image, size)] = n
    return tuple((k, v) for k, v in out.items() if v)


def _by_type(annotation: Any) -> Reader:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) and len(args) == 1:
        annotation = args[0]
    origin = typing.get_origin(annotation) or annotation
    readers: dict[Any, Reader] = {
        int: read_int,
        float: read_float,
        str: lambda _n, raw: raw,
        Path: lambda _n, raw: Path(raw),
        list: read_list,
    }
    if origin not in readers:
        raise TypeError(f"give {annotation} an Env(read=...)")
    return readers[origin]


def read_field(field: FieldInfo, default: Any = None) -> Any:
    """The field's value in the environment; ``default`` when its variable is unset or blank."""
    env = env_of(field)
    raw = os.environ.get(env.name)
    if raw is None or raw.strip() == "":
        return default
    return (env.read or _by_type(field.annotation))(env.name, raw)


def clamp(field: FieldInfo, value: Any) -> Any:
    env = env_of(field)
    if value is None:
        return value
    if env.lo is not None and value < env.lo:
        return type(value)(env.lo)
    if env.hi is not None and value > env.hi:
        return type(value)(env.hi)
    return value


# Settings.from_env reads the environment; keyword construction alone does not.
_READING: ContextVar[bool] = ContextVar("pal_settings_reading_env", default=False)


@contextmanager
def reading_env() -> Iterator[None]:
    token = _READING.set(True)
    try:
        yield
    finally:
        _READING.reset(token)


_UNSET = object()


class EnvSource(PydanticBaseSettingsSource):
    """Each declared variable that is set, read by its Env (errors name the variable)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return read_field(field, _UNSET), field_name, False

    def __call__(self) -> dict[str, Any]:
        if not _READING.get():
            return {}
        values = {name: read_field(f, _UNSET) for name, f in self.settings_cls.model_fields.items()}
        return {name: v for name, v in values.items() if v is not _UNSET}


# -- what a running server uses (GET /v1/operator/host, `pal doctor`) --

_SECRET = re.compile(r"SECRET|TOKEN|PASSWORD|_KEY$")
_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")


def effective(settings: BaseSettings) -> dict[str, Any]:
    """Each setting's variable and the value in effect, JSON-ready; a secret only says
    whether it is set, a URL's password is hidden."""
    out: dict[str, Any] = {}
    for name, field in type(settings).model_fields.items():
        var, value = env_of(field).name, getattr(settings, name)
        if _SECRET.search(var):
            value = "(set)" if value else None
        elif isinstance(value, str):
            value = _URL_PASSWORD.sub(r"\1***@", value)
        elif isinstance(value, Path):
            value = str(value)
        elif not isinstance(value, int | float | bool | type(None)):
            value = json.loads(json.dumps(value, default=str))
        out[var] = value
    return out


# -- README's table --

BEGIN = "<!-- settings table: generated by `python -m pal.config --markdown --write` -->"
END = "<!-- end of the settings table -->"


def _shown(field: FieldInfo) -> str:
    env = env_of(field)
    if env.shown is not None:
        return env.shown
    default = field.get_default(call_default_factory=True)
    if default in (None, [], {}, ""):
        return "unset"
    if isinstance(default, tuple):
        default = ",".join(default)
    if isinstance(default, float):
        default = f"{default:g}"
    return f"`{default}`"


def _bounds(env: Env) -> str:
    shown = [
        f"{word} {bound:g}"
        for word, bound in (("at least", env.lo), ("at most", env.hi))
        if bound is not None
    ]
    return f"; {', '.join(shown)}" if shown else ""


def markdown(settings_cls: type[BaseSettings]) -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for field in settings_cls.model_fields.values():
        env = env_of(field)
        rows.append(f"| `{env.name}` | {_shown(field)} | {env.doc}{_bounds(env)} |")
    return "\n".join(rows) + "\n"


def with_table(readme: str, table: str) -> str:
    """README's text with the table between the markers replaced."""
    head, _, rest = readme.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END)
    if not rest or not tail:
        raise ValueError("README.md has no settings table markers")
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(settings_cls: type[BaseSettings], readme: Path) -> int:
    parser = argparse.ArgumentParser(prog="python -m pal.config", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print README's configuration table")
    parser.add_argument("--write", action="store_true", help="write it into README.md between its markers")
    args = parser.parse_args()
    table = markdown(settings_cls)
    if args.write:
        readme.write_text(with_table(readme.read_text(), table))
    elif args.markdown:
        sys.stdout.write(table)
    else:
        parser.print_help()
    return 0


def parse_nameservers(raw: str | None) -> list[tuple[str, int]]:
    """PAL_EGRESS_NAMESERVERS: ``ip``, ``ip:port``, ``[ipv6]:port``, comma-separated."""
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in (raw or "").split(",")):
        if not part:
            continue
        host, port = part, 53
        try:
            if part.startswith("["):
                host, _, rest = part[1:].partition("]")
                port = int(rest[1:]) if rest.startswith(":") else 53
            elif part.count(":") == 1:
                host, _, num = part.partition(":")
                port = int(num)
            ipaddress.ip_address(host)
        except ValueError as exc:
            raise ValueError(f"PAL_EGRESS_NAMESERVERS entry {part!r} is not ip[:port]") from exc
        if not 1 <= port <= 65535:
            raise ValueError(f"PAL_EGRESS_NAMESERVERS entry {part!r}: port outside 1-65535")
        out.append((host, port))
    return out


def read_nameservers(_name: str, raw: str) -> str:
    parse_nameservers(raw)  # a malformed entry fails at start, naming it
    return raw.strip()
