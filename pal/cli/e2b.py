"""`pal e2b`: E2B's SDKs against a Pal server (docs/e2b.md)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from pal.e2b.keys import is_e2b_key
from pal.e2b.versions import ENVD_PORT

from .output import err_console

DEFAULT_URL = "http://127.0.0.1:8080"

e2b_app = typer.Typer(
    help="Run E2B's unmodified SDKs against this server.",
    no_args_is_help=True,
    epilog='Examples:\n\n  eval "$(pal e2b env)"   # then run an E2B program as it is',
)


def env_lines(url: str, key: str, sandbox_port: int = ENVD_PORT) -> list[str]:
    """The `export` lines pointing E2B's SDKs at the Pal server at ``url``: its REST API
    under /e2b, the agent listener on ``sandbox_port`` of the same host, and the key (a
    key not of E2B's ``e2b_<hex>`` form needs E2B_VALIDATE_API_KEY=false)."""
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be an http(s) URL of a Pal server, got {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    api = shlex.quote(f"{parts.scheme}://{parts.netloc}{parts.path}/e2b")
    lines = [
        f"export E2B_API_URL={api}",
        f"export E2B_VOLUME_API_URL={api}",  # the volume content API (Volume.read_file...)
        f"export E2B_SANDBOX_URL={shlex.quote(f'{parts.scheme}://{host}:{sandbox_port}')}",
        f"export E2B_API_KEY={shlex.quote(key)}",
    ]
    if not is_e2b_key(key):
        lines.append("export E2B_VALIDATE_API_KEY=false")
    return lines


def _cache_path() -> Path:
    return Path.home() / ".config" / "pal" / "e2b-keys.json"


def e2b_key_for(url: str, pal_key: str, make: bool = True) -> str | None:
    """The E2B key this machine made for ``pal_key`` on the server at ``url`` (kept in
    ~/.config/pal/e2b-keys.json, 0600, by the hash of the Pal key), or a new one made
    through the server's ``POST /e2b/api-keys``; None when the server made none."""
    import httpx

    path = _cache_path()
    slot = hashlib.sha256(f"{url.rstrip('/')}\n{pal_key}".encode()).hexdigest()
    try:
        cached: dict[str, str] = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if slot in cached and is_e2b_key(cached[slot]):
        return cached[slot]
    if not make:
        return None
    try:
        r = httpx.post(
            url.rstrip("/") + "/e2b/api-keys",
            headers={"X-API-KEY": pal_key},
            json={"name": "pal e2b env"},
            timeout=30,
        )
    except httpx.HTTPError as exc:
        err_console.print(f"no E2B key made ({exc}): using the Pal key with E2B_VALIDATE_API_KEY=false")
        return None
    if r.status_code != 201:
        err_console.print(f"no E2B key made ({r.status_code} {r.text[:200]}): using the Pal key")
        return None
    key = str(r.json()["key"])
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    cached[slot] = key
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cached))
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    return key


@e2b_app.command("env")
def env(
    url: Annotated[
        str,
        typer.Option(
            metavar="URL", envvar="PAL_URL", help="Pal server (default PAL_URL or http://127.0.0.1:8080)"
        ),
    ] = DEFAULT_URL,
    key: Annotated[
        str,
        typer.Option("--api-key", metavar="KEY", envvar="PAL_API_KEY", help="the tenant's key (PAL_API_KEY)"),
    ] = "",
    sandbox_port: Annotated[
        int, typer.Option(metavar="PORT", help="the server's agent listener (PAL_E2B_PORT)")
    ] = ENVD_PORT,
    pal_key: Annotated[
        bool,
        typer.Option(
            "--pal-key", help="print the Pal key itself (E2B_VALIDATE_API_KEY=false), make no E2B key"
        ),
    ] = False,
) -> None:
    """Print the export lines for E2B's SDKs: E2B_API_URL, E2B_VOLUME_API_URL, E2B_SANDBOX_URL, E2B_API_KEY.

    With a Pal key (PAL_API_KEY, pal_...) the server makes the tenant an E2B key (e2b_ and
    hex, as E2B's SDKs want; once per machine: ~/.config/pal/e2b-keys.json keeps it);
    revoke it with `pal tenants keys revoke`. An E2B key in PAL_API_KEY is used as it is.
    """
    if not key:
        err_console.print("PAL_API_KEY is not set: export a tenant's key first (pal tenants create)")
        raise typer.Exit(2)
    if not is_e2b_key(key) and not pal_key:
        key = e2b_key_for(url, key) or key
    try:
        lines = env_lines(url, key, sandbox_port)
    except ValueError as exc:
        err_console.print(str(exc))
        raise typer.Exit(2) from None
    for line in lines:
        typer.echo(line)
