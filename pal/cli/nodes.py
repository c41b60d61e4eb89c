"""`pal node`: run this machine's node agent, and the operator's node commands.

``pal node --server URL ...`` (no subcommand) runs the node. ``ls``, ``drain`` and
``activate`` talk to a control-plane replica (``PAL_URL``) with the operator token
(``PAL_ADMIN_TOKEN``, else ``<data dir>/keys/operator.token``: pal/operator.py);
``token`` derives a node's token from ``PAL_CLUSTER_SECRET`` (run it where the secret is).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from .output import Table, fail, print_json, print_rows

node_app = typer.Typer(
    help="Run a node (`pal node --server URL`), or list, drain and reactivate nodes.",
    invoke_without_command=True,
)

NODE_COLUMNS = [
    "nodeId",
    "state",
    "healthy",
    "region",
    "vmsLive",
    "vmsPlaced",
    "memoryMibPlaced",
    "lastSeenSecsAgo",
]


@node_app.callback()
def run_node(
    ctx: typer.Context,
    server: Annotated[
        list[str] | None, typer.Option("--server", help="control-plane URL (repeatable; default PAL_SERVERS)")
    ] = None,
    port: Annotated[int, typer.Option(help="TCP port of this node's RPC")] = 8081,
    host: Annotated[str, typer.Option(help="address the RPC listens on")] = "127.0.0.1",
    advertise_url: Annotated[
        str | None, typer.Option(help="URL the control plane reaches this node at (default http://HOST:PORT)")
    ] = None,
    name: Annotated[str | None, typer.Option(help="node id (default PAL_NODE_NAME or the host name)")] = None,
    region: Annotated[str | None, typer.Option(help="region (default PAL_NODE_REGION)")] = None,
    label: Annotated[list[str] | None, typer.Option(help="k=v label for placement (repeatable)")] = None,
    memory_mib: Annotated[
        int | None, typer.Option(help="guest RAM this node hands out (default: host RAM - 1 GiB)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="this node's data directory")] = None,
    accel: Annotated[str | None, typer.Option(help="auto | kvm | tcg")] = None,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from pal.config import Settings, parse_labels

    settings = Settings.from_env(data_dir)
    if accel is not None:
        if accel not in ("auto", "kvm", "tcg"):
            raise typer.BadParameter("--accel must be auto, kvm or tcg")
        settings.accel = accel
    if name:
        settings.node_name = name
    if region is not None:
        settings.node_region = region
    if label:
        try:
            settings.node_labels = {**settings.node_labels, **parse_labels(label)}
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    if memory_mib is not None:
        settings.node_memory_mib = memory_mib
    servers = list(server or []) or settings.servers
    from pal import node

    node.run(settings, servers, host, port, advertise_url)


def _admin(method: str, path: str, body: Any = None) -> Any:
    import httpx

    url = os.environ.get("PAL_URL", "http://127.0.0.1:8080").rstrip("/")
    from pal.config import Settings
    from pal.operator import client_token

    token = client_token(Settings.from_env())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.request(method, url + path, json=body, headers=headers, timeout=600)
    except httpx.HTTPError as exc:
        fail(f"cannot reach {url}: {exc}", "UNAVAILABLE")
    if resp.status_code == 401 and not token:
        fail(
            "no operator token at hand: run this as root on the server's host (it reads "
            "<data dir>/keys/operator.token; PAL_DATA_DIR if not /var/lib/pal), or set PAL_ADMIN_TOKEN",
            "UNAUTHENTICATED",
        )
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
            fail(err["message"], err["code"])
        except (ValueError, KeyError, TypeError):
            fail(f"{url} answered {resp.status_code}: {resp.text[:200]}")
    return resp.json()


@node_app.command("ls")
def ls(table: Table = False) -> None:
    """Nodes, their capacity and health."""
    nodes = _admin("GET", "/v1/nodes")["nodes"]
    print_rows(nodes, NODE_COLUMNS, table)


@node_app.command("drain")
def drain(
    node_id: Annotated[str, typer.Argument(help="node id")],
    migrate: Annotated[bool, typer.Option(help="resume its VMs on other nodes at once")] = False,
) -> None:
    """Take new VMs off NODE and snapshot-pause its running VMs.

    Their next request resumes them on another node (with --migrate, they resume elsewhere
    now)."""
    print_json(_admin("POST", f"/v1/nodes/{node_id}/drain", {"migrate": migrate}))


@node_app.command("activate")
def activate(node_id: Annotated[str, typer.Argument(help="node id")]) -> None:
    """Let a drained node take new VMs again."""
    print_json(_admin("POST", f"/v1/nodes/{node_id}/activate"))


@node_app.command("token")
def token(node_id: Annotated[str, typer.Argument(help="node id (its --name)")]) -> None:
    """Print NODE's token (derived from PAL_CLUSTER_SECRET); give it to that node as PAL_NODE_TOKEN."""
    from pal.config import Settings
    from pal.wire.auth import node_token

    secret = Settings.from_env().cluster_secret
    if not secret:
        fail("PAL_CLUSTER_SECRET is not set", "INVALID_ARGUMENT")
    typer.echo(node_token(secret, node_id))
