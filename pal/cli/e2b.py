"""`pal e2b`: E2B's SDKs against a Pal server (docs/e2b.md)."""

from __future__ import annotations

import shlex
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
    lines = [
        f"export E2B_API_URL={shlex.quote(f'{parts.scheme}://{parts.netloc}{parts.path}/e2b')}",
        f"export E2B_SANDBOX_URL={shlex.quote(f'{parts.scheme}://{host}:{sandbox_port}')}",
        f"export E2B_API_KEY={shlex.quote(key)}",
    ]
    if not is_e2b_key(key):
        lines.append("export E2B_VALIDATE_API_KEY=false")
    return lines


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
) -> None:
    """Print the export lines for E2B's SDKs: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY.

    The key is PAL_API_KEY. A Pal key (pal_...) works with E2B_VALIDATE_API_KEY=false,
    printed too; a key of E2B's form (e2b_ and hex) needs nothing more.
    """
    if not key:
        err_console.print("PAL_API_KEY is not set: export a tenant's key first (pal tenants create)")
        raise typer.Exit(2)
    try:
        lines = env_lines(url, key, sandbox_port)
    except ValueError as exc:
        err_console.print(str(exc))
        raise typer.Exit(2) from None
    for line in lines:
        typer.echo(line)
