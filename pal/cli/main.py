"""`pal`: run the server, build images, manage tenants, and drive sandboxes from a shell.

Server-side commands (up, image, doctor, tenants) import their modules lazily so `pal vm
...` stays fast and works on a machine that has only the SDK's dependencies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pal.sizes import DEFAULT_MEMORY_MIB, DEFAULT_PRESTART, size_name

from . import code as _code  # noqa: F401  (registers `pal vm code` on vm_app)
from . import help as cli_help
from .image import image_app
from .nodes import node_app
from .output import Table, fail, mode, print_json, print_rows, print_table
from .settings import say, server_settings
from .snapshots import snapshots_app
from .vm import files_app, vm_app
from .vm_processes import vm_app as _processes  # noqa: F401  (registers shell, ps, attach, kill)

cli_help.install()
app = typer.Typer(
    name="pal",
    help="Pal: self-hostable microVM sandboxes for AI agents.",
    no_args_is_help=True,
    epilog=cli_help.examples(
        "sudo pal up                                  # server + node on this machine",
        "export PAL_API_KEY=$(sudo pal tenants create me -q)",
        "VM=$(pal vm schedule -q)",
        "pal vm exec $VM -- python3 -c 'print(42)'",
        "pal vm pause $VM && pal vm resume $VM",
        "pal vm rm $VM",
    ),
)
tenants_app = typer.Typer(help="Tenants and their API keys (opens the store directly).", no_args_is_help=True)
data_dir_app = typer.Typer(help="The data directory's loop-mounted file system.", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(tenants_app, name="tenants")
app.add_typer(data_dir_app, name="data-dir")
app.add_typer(vm_app, name="vm")
app.add_typer(files_app, name="files")
app.add_typer(node_app, name="node")
app.add_typer(snapshots_app, name="snapshots")

DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="data directory (default PAL_DATA_DIR or /var/lib/pal)")
]
# A benchmark's own server runs on a data dir whose image is built already.
BenchDataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="a data dir with a built image (default PAL_TEST_DATA_DIR)")
]


Database = Annotated[
    str | None,
    typer.Option(
        "--database", help="PostgreSQL URL (default PAL_DATABASE_URL; unset: SQLite in the data dir)"
    ),
]


def _accel(settings: Any, accel: str | None) -> None:
    if accel is not None:
        if accel not in ("auto", "kvm", "tcg"):
            raise typer.BadParameter("--accel must be auto, kvm or tcg")
        settings.accel = accel


@data_dir_app.command("umount")
def data_dir_umount(data_dir: DataDir = None) -> None:
    """Unmount the reflink XFS image Pal loop-mounted on the data dir (stop `pal up` first).

    `pal up` and `pal image build` mount it again when needed; the image file is kept.
    """
    from pal.errors import PalError
    from pal.vmm.datadir import umount_reflink_datadir

    try:
        umount_reflink_datadir(server_settings(data_dir), say)
    except PalError as exc:
        from .output import fail

        fail(exc.message, exc.code)


@app.callback()
def main(
    json_errors: Annotated[
        bool, typer.Option("--json", help="errors as JSON on stderr, for scripts (results are JSON already)")
    ] = False,
) -> None:
    """Pal: self-hostable microVM sandboxes for AI agents.

    `pal up` runs everything on this machine; `pal vm ...` and `pal files ...` talk to it
    over HTTP (PAL_URL, default http://127.0.0.1:8080, and PAL_API_KEY).
    """
    mode.json_errors = json_errors


PortsPort = Annotated[
    int | None,
    typer.Option(
        "--ports-port",
        help="port of the ports listener: VM ports at http://PORT-VM.localhost:PORTS_PORT "
        "(default PAL_PORTS_PORT or 8082)",
    ),
]


def _ports_port(settings: Any, ports_port: int | None) -> None:
    if ports_port is not None:
        if not 1 <= ports_port <= 65535:
            raise typer.BadParameter(f"--ports-port must be 1-65535, got {ports_port}")
        settings.ports_port = ports_port


@app.command()
def up(
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    data_dir: DataDir = None,
    accel: Annotated[str | None, typer.Option(help="auto | kvm | tcg (default PAL_ACCEL or auto)")] = None,
    database: Database = None,
    ports_port: PortsPort = None,
) -> None:
    """Run the server, runtime manager and store on this machine (until SIGTERM/Ctrl-C)."""
    settings = server_settings(data_dir)
    _ports_port(settings, ports_port)
    _accel(settings, accel)
    if database:
        settings.database_url = database
    from pal import server

    server.run(settings, host, port)


@app.command()
def server(
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    database: Database = None,
    advertise_url: Annotated[
        str | None, typer.Option(help="URL other replicas reach this one at (default http://HOST:PORT)")
    ] = None,
    ports_port: PortsPort = None,
) -> None:
    """Run a control-plane replica: API, scheduler, operator routes (nodes run `pal node`).

    Several replicas share one PostgreSQL; one leads, the others forward to it."""
    settings = server_settings(None)
    _ports_port(settings, ports_port)
    if database:
        settings.database_url = database
    if not settings.database_url:
        raise typer.BadParameter(
            "pal server needs PostgreSQL: --database or PAL_DATABASE_URL (pal up embeds SQLite)"
        )
    from pal import server as server_mod

    try:
        advertise_url = server_mod.advertised_url(host, port, advertise_url)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    server_mod.run_control_plane(settings, host, port, advertise_url)


@app.command()
def doctor(
    data_dir: DataDir = None,
    url: Annotated[
        str | None, typer.Option(help="server to check (default PAL_URL or http://127.0.0.1:8080)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="the checks as JSON")] = False,
) -> None:
    """Check this host and a running Pal; exits 1 when a check fails.

    QEMU, accelerator, reflinks, cgroups, jail, image, network, snapshots, store, server and
    runtime manager."""
    import logging

    from pal.ops import doctor as doc

    # The first KVM probe boots a tiny VM (up to a few seconds): say so while it runs.
    logging.basicConfig(level=logging.WARNING, format="pal: %(message)s")
    logging.getLogger("pal.vmm.accel").setLevel(logging.INFO)
    from pal.sdk._wire import resolve

    checks = doc.run(server_settings(data_dir), resolve(url, None)[0])
    if as_json:
        print_json([{"check": c.name, "ok": c.ok, "detail": c.detail} for c in checks])
    else:
        marks = {True: "ok", False: "FAIL", None: "-"}
        print_table(
            [{"check": c.name, "": marks[c.ok], "detail": c.detail} for c in checks], ["check", "", "detail"]
        )
    if any(c.ok is False for c in checks):
        raise typer.Exit(1)


@app.command(
    epilog=cli_help.examples(
        "PAL_URL=http://127.0.0.1:8080 PAL_API_KEY=... pal mcp   # what a desktop client runs",
    )
)
def mcp(
    url: Annotated[
        str | None, typer.Option(help="Pal server (default PAL_URL or http://127.0.0.1:8080)")
    ] = None,
) -> None:
    """Serve Pal's sandbox tools to an MCP client over stdio (docs/agents.md).

    Started by the client (Claude Desktop, an agent framework) as a subprocess; every tool
    call goes to the Pal server at PAL_URL with PAL_API_KEY. The server also serves the same
    tools at /mcp (Streamable HTTP, the key as a bearer token)."""
    from pal.mcp.stdio import run_stdio

    run_stdio(url)


def _store_settings(data_dir: Path | None, database: str | None) -> Any:
    settings = server_settings(data_dir)
    if database:
        settings.database_url = database
    return settings


def _tenant_json(t: Any) -> dict[str, Any]:
    gib = t.max_snapshot_bytes / (1 << 30) if t.max_snapshot_bytes is not None else None
    return {
        "id": t.id,
        "name": t.name,
        "maxVms": t.max_vms,
        "maxPaused": t.max_paused,
        "maxSnapshotGib": gib,
        "keyExpiresAt": t.api_key_expires_at.isoformat() if t.api_key_expires_at else None,
        "deleting": t.deleting_at is not None,
        "createdAt": t.created_at.isoformat(),
    }


def _limit(value: str | None, what: str, scale: float = 1) -> int | None:
    """A limit option: a number, or `none` for no limit."""
    if value is None or value.lower() == "none":
        return None
    try:
        n = float(value)
    except ValueError:
        raise typer.BadParameter(f"{what} must be a number or 'none'") from None
    if n < 0:
        raise typer.BadParameter(f"{what} must be 0 or more")
    return int(n * scale)


MaxPaused = Annotated[str | None, typer.Option("--max-paused", help="paused VMs at once (none: no limit)")]
MaxSnapshotGib = Annotated[
    str | None, typer.Option("--max-snapshot-gib", help="GiB of snapshots kept (none: no limit)")
]
KeyTtlDays = Annotated[
    float | None, typer.Option("--key-ttl-days", help="the API key expires after this many days")
]


def _with_store(data_dir: Path | None, database: str | None, fn: Any) -> Any:
    """Run ``fn(store)``; a PalError becomes a clear CLI failure."""
    from pal.errors import PalError
    from pal.store import Store

    settings = _store_settings(data_dir, database)
    if not settings.database_url and not settings.db_path.exists():
        # Not a data dir a server has used (a typo, PAL_DATA_DIR not exported in this shell,
        # or its XFS image not mounted yet): a new store here would be one no server reads.
        fail(
            f"no Pal store in {settings.data_dir} ({settings.db_path.name} is missing): give the data "
            f"dir your server uses (--data-dir or PAL_DATA_DIR), after starting `pal up` there once",
            "NOT_FOUND",
        )
    store = Store.open(settings)
    try:
        return fn(store)
    except PalError as exc:
        fail(exc.message, exc.code)
    finally:
        store.close()


def _find_tenant(store: Any, name_or_id: str) -> Any:
    from pal.errors import NotFound

    t = store.get_tenant(name_or_id) or store.tenant_by_name(name_or_id)
    if t is None:
        raise NotFound(f"no tenant {name_or_id!r}")
    return t


@tenants_app.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument(help="tenant name (unique)")],
    max_vms: Annotated[int, typer.Option("--max-vms", help="concurrent VM quota")] = 10,
    max_paused: MaxPaused = None,
    max_snapshot_gib: MaxSnapshotGib = None,
    key_ttl_days: KeyTtlDays = None,
    data_dir: DataDir = None,
    database: Database = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the API key")] = False,
) -> None:
    """Create a tenant and print its API key (shown only once: only a hash is kept)."""
    from datetime import timedelta

    ttl = timedelta(days=key_ttl_days) if key_ttl_days is not None else None
    tenant, key = _with_store(
        data_dir,
        database,
        lambda store: store.create_tenant(
            name,
            max_vms,
            max_paused=_limit(max_paused, "--max-paused"),
            max_snapshot_bytes=_limit(max_snapshot_gib, "--max-snapshot-gib", 1 << 30),
            key_ttl=ttl,
        ),
    )
    if quiet:
        typer.echo(key)
    else:
        print_json({**_tenant_json(tenant), "apiKey": key})


@tenants_app.command("set")
def tenants_set(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    max_vms: Annotated[int | None, typer.Option("--max-vms", help="concurrent VM quota")] = None,
    max_paused: MaxPaused = None,
    max_snapshot_gib: MaxSnapshotGib = None,
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Change a tenant's limits (options not given stay as they are).

    A lower limit applies to what comes next: nothing running is stopped."""
    changes: dict[str, Any] = {}
    if max_vms is not None:
        changes["max_vms"] = max_vms
    if max_paused is not None:
        changes["max_paused"] = _limit(max_paused, "--max-paused")
    if max_snapshot_gib is not None:
        changes["max_snapshot_bytes"] = _limit(max_snapshot_gib, "--max-snapshot-gib", 1 << 30)
    updated = _with_store(
        data_dir, database, lambda store: store.set_tenant_limits(_find_tenant(store, tenant).id, **changes)
    )
    print_json(_tenant_json(updated))


@tenants_app.command("rotate-key")
def tenants_rotate_key(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    grace_secs: Annotated[
        float, typer.Option("--grace-secs", help="the old key keeps working this long (0: refused at once)")
    ] = 0,
    key_ttl_days: KeyTtlDays = None,
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Give the tenant a new API key (printed once); the old one stops working after the grace."""
    from datetime import timedelta

    ttl = timedelta(days=key_ttl_days) if key_ttl_days is not None else None

    def rotate(store: Any) -> tuple[Any, str]:
        t = _find_tenant(store, tenant)
        key = store.rotate_api_key(t.id, grace=timedelta(seconds=grace_secs), key_ttl=ttl)
        return store.get_tenant(t.id), key

    t, key = _with_store(data_dir, database, rotate)
    print_json({**_tenant_json(t), "apiKey": key})


@tenants_app.command("rm")
def tenants_rm(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    data_dir: DataDir = None,
    database: Database = None,
) -> None:
    """Remove a tenant: its keys are refused at once, then its VMs and snapshots go.

    The server (its leader) deletes the tenant's VMs and their snapshots, locally and in S3,
    and finally the tenant."""
    t = _with_store(
        data_dir, database, lambda store: store.mark_tenant_deleting(_find_tenant(store, tenant).id)
    )
    print_json({**_tenant_json(t), "note": "keys refused now; the server deletes its VMs and snapshots"})


TENANT_COLUMNS = ["id", "name", "maxVms", "maxPaused", "maxSnapshotGib", "keyExpiresAt", "createdAt"]


@tenants_app.command("ls")
def tenants_ls(
    data_dir: DataDir = None,
    table: Table = False,
    database: Database = None,
) -> None:
    """List tenants (never their keys)."""
    rows = _with_store(data_dir, database, lambda store: [_tenant_json(t) for t in store.list_tenants()])
    print_rows(rows, TENANT_COLUMNS, table)


bench_app = typer.Typer(
    help="Benchmarks: the latency table, `images`, `network`, `cluster`, `control-plane`, `wait`, "
    "`processes`, `peer`."
)
app.add_typer(bench_app, name="bench")


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    iterations: Annotated[int, typer.Option(help="iterations per measurement (p50/p90)")] = 20,
    fork_iterations: Annotated[int, typer.Option(help="iterations of the fork fan-out runs")] = 3,
    memory_mib: Annotated[int, typer.Option(help="guest RAM of the measured VMs")] = DEFAULT_MEMORY_MIB,
    url: Annotated[str | None, typer.Option(help="measure a running server (with --api-key)")] = None,
    api_key: Annotated[str | None, typer.Option(help="tenant key for --url")] = None,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where runtime-latency.md goes")] = Path("docs/benchmarks"),
    only: Annotated[
        str | None, typer.Option(help="main (the latency table) or steady (repeated cycles, readiness)")
    ] = None,
    steady_runs: Annotated[int, typer.Option(help="VMs taken through the 30 pause/resume cycles")] = 5,
    ready_runs: Annotated[int, typer.Option(help="`pal up` starts timed from readiness to a first exec")] = 3,
) -> None:
    """Latency benchmarks (snapshot, restore, fork, first exec, stop, cold boot) and the
    steady state (repeated cycles of one VM, under load, readiness → first exec)."""
    if ctx.invoked_subcommand is not None:
        return
    from pal.bench import latency as bench_mod

    if only not in (None, *bench_mod.SECTIONS):
        raise typer.BadParameter(f"--only takes one of {', '.join(bench_mod.SECTIONS)}")
    bench_mod.main(
        iterations=iterations,
        fork_iterations=fork_iterations,
        memory_mib=memory_mib,
        url=url,
        api_key=api_key,
        data_dir=data_dir,
        out_dir=out_dir,
        sections=(only,) if only else bench_mod.SECTIONS,
        steady_runs=steady_runs,
        ready_runs=ready_runs,
    )


@bench_app.command("cluster")
def bench_cluster(
    iterations: Annotated[int, typer.Option(help="resumes timed each way (p50/p90)")] = 5,
    failovers: Annotated[int, typer.Option(help="leader kills timed")] = 10,
    schedules: Annotated[int, typer.Option(help="VMs scheduled per throughput run")] = 8,
    data_dir: BenchDataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where cluster.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Cluster on one machine: schedule throughput (1 vs 3 nodes), failover, resume from S3."""
    from pal.bench import cluster as mod

    mod.main(
        iterations=iterations,
        failover_runs=failovers,
        schedules=schedules,
        data_dir=data_dir,
        out_dir=out_dir,
    )


@bench_app.command("control-plane")
def bench_control_plane(
    records: Annotated[
        int | None, typer.Option(help="sandbox records in the store (none: the ladder 10^4, 10^5, 10^6)")
    ] = None,
    nodes: Annotated[
        int | None, typer.Option(help="simulated nodes (default: records / 1000, at least 10)")
    ] = None,
    out_dir: Annotated[Path, typer.Option(help="where control-plane.{json,md} go")] = Path("docs/benchmarks"),
    seconds: Annotated[float, typer.Option(help="seconds of schedules")] = 20.0,
    idle_secs: Annotated[float, typer.Option(help="seconds of the idle phase (loops measured)")] = 30.0,
    concurrency: Annotated[int, typer.Option(help="API calls in flight")] = 32,
    spawn_ms: Annotated[float, typer.Option(help="a simulated node's spawn time")] = 50.0,
    snapshot_ms: Annotated[float, typer.Option(help="a simulated node's snapshot time")] = 50.0,
    restore_ms: Annotated[float, typer.Option(help="a simulated node's restore time")] = 50.0,
) -> None:
    """The control plane at 10^4-10^6 sandbox records: PostgreSQL, 2 replicas, simulated nodes.

    docs/scale.md says what it measures; the report goes to control-plane.{json,md}."""
    from pal.bench import control_plane as mod
    from pal.bench.simnode import SimTimes

    times = SimTimes(spawn_ms=spawn_ms, restore_ms=restore_ms, snapshot_ms=snapshot_ms)
    opts = mod.Options(seconds=seconds, idle_secs=idle_secs, concurrency=concurrency, times=times)
    mod.main(records, nodes, out_dir, opts)


@bench_app.command("s3")
def bench_s3(
    iterations: Annotated[int, typer.Option(help="resumes timed each way, encrypted and not")] = 5,
    data_dir: BenchDataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where s3-snapshots.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Resume from S3 as a ratio to a warm exec, snapshots encrypted and not."""
    from pal.bench import s3 as bench_s3

    bench_s3.main(iterations=iterations, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("density")
def bench_density(
    cap: Annotated[int, typer.Option(help="sandboxes at most (a shared machine: start modest)")] = 30,
    data_dir: BenchDataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where density.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Sandboxes of 256 MiB per node until it refuses one: per tier, memory, wakes, GET/list."""
    from pal.bench import density

    density.main(cap=cap, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("network")
def bench_network(
    iterations: Annotated[int, typer.Option(help="connections timed (p50/p90)")] = 100,
    size_mib: Annotated[int, typer.Option(help="size of each download into the guest")] = 256,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where network.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Network: throughput, connection setup, gateway CPU, refusals, ports, brokered HTTPS.

    Download into the guest vs its own pipe, connection setup through the
    gateway vs on the host, gateway CPU per GiB, refusal latency, namespace set-up, time to
    first byte through a port, a brokered HTTPS request vs a pass-through one, and the cost
    of the SNI/Host checks and of the response redaction as ratios."""
    from pal.bench import network as bench_network

    bench_network.main(iterations=iterations, size_mib=size_mib, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("code")
def bench_code(
    iterations: Annotated[int, typer.Option(help="cells and schedules timed (p50/p90)")] = 10,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where code.md goes")] = Path("docs/benchmarks"),
) -> None:
    """The code interpreter against the same run's warm exec: a cell, schedule → first cell, fork ×5.

    Needs the code-interpreter image (`pal image build code-interpreter`)."""
    from pal.bench import code as bench_code_mod

    bench_code_mod.main(iterations=iterations, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("images")
def bench_images(
    iterations: Annotated[int, typer.Option(help="template schedules timed per image (p50/p90)")] = 10,
    memory_mib: Annotated[int, typer.Option(help="guest RAM of the measured VMs")] = DEFAULT_MEMORY_MIB,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where images.md goes")] = Path("docs/benchmarks"),
) -> None:
    """A custom image (imported busybox) beside the default one: import, first schedules.

    Import, first schedule (cold) and schedule from its own template to the first exec,
    beside the default image's rows of the same run."""
    from pal.bench import images as bench_images

    bench_images.main(iterations=iterations, memory_mib=memory_mib, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("fanout")
def bench_fanout(
    iterations: Annotated[int, typer.Option(help="warm execs and snapshot pauses timed (p50)")] = 5,
    memory_mib: Annotated[int, typer.Option(help="guest RAM of the measured VMs")] = DEFAULT_MEMORY_MIB,
    n100: Annotated[bool, typer.Option(help="fork N=100 too (the default fork cap)")] = False,
    only: Annotated[str | None, typer.Option(help="one section: fork, pause or cycles")] = None,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where fanout.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Fork fan-out, the snapshot pause with live state, and the steady cycles.

    Fork N=1/10/50 (every child up, per-child wait for CPU, restore, identify, first exec
    and CPU share), the snapshot pause with 64 MiB of live state, and the pause/resume
    cycles of one VM, as ratios to the same run's warm exec (docs/benchmarks/fanout.md)."""
    from pal.bench import fanout as bench_fanout
    from pal.config import Settings

    ns = (*bench_fanout.FORK_NS, 100) if n100 else bench_fanout.FORK_NS
    sections = (only,) if only else ("fork", "pause", "cycles")
    report = bench_fanout.main(
        data_dir=data_dir or Settings.from_env().data_dir,
        out_json=out_dir / "fanout.json",
        iterations=iterations,
        memory_mib=memory_mib,
        fork_ns=ns,
        sections=sections,
    )
    (out_dir / "fanout.md").write_text(bench_fanout.render_markdown(report))


@bench_app.command("prestart")
def bench_prestart(
    iterations: Annotated[int, typer.Option(help="warm execs and resumes timed per round")] = 10,
    rounds: Annotated[int, typer.Option(help="rounds per mode (off and on alternate)")] = 3,
    memory_mib: Annotated[int, typer.Option(help="guest RAM of the measured VMs")] = DEFAULT_MEMORY_MIB,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where prestart.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Pre-started QEMUs off and on: resume into a new QEMU, fork ×10 → all answered.

    Each as a ratio to the same mode's warm exec, in rounds alternating PAL_PRESTART=0
    and on (docs/benchmarks/prestart.md)."""
    from pal.bench import prestart as bench_prestart
    from pal.config import Settings

    bench_prestart.main(
        data_dir=data_dir or Settings.from_env().data_dir,
        out_dir=out_dir,
        iterations=iterations,
        rounds=rounds,
        memory_mib=memory_mib,
        prestart=f"{size_name(memory_mib)}:{DEFAULT_PRESTART[0][1]}",
    )


@bench_app.command("wait")
def bench_wait(
    iterations: Annotated[int, typer.Option(help="iterations per latency (p50/p90)")] = 20,
    waits: Annotated[int, typer.Option(help="waits in a row on one VM (0: skip)")] = 100,
    scenario_runs: Annotated[int, typer.Option(help="runs of the 10 s wait scenario")] = 3,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where wait.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Live pause: pause and resume, offload, wakes, the wait scenario, fork RAM mapping.

    Live pause and resume, offload, first exec after a wake (idle live tier), the wait
    scenario (a model answering after 10 s), waits in a row, fork RAM mapping."""
    from pal.bench import wait as bench_wait

    bench_wait.main(
        iterations=iterations, waits=waits, scenario_runs=scenario_runs, data_dir=data_dir, out_dir=out_dir
    )


@bench_app.command("processes")
def bench_processes(
    iterations: Annotated[int, typer.Option(min=3, help="iterations per latency (echo: 5x this)")] = 20,
    size_mib: Annotated[int, typer.Option(min=1, max=60, help="output of the throughput runs")] = 32,
    idle_processes: Annotated[int, typer.Option(min=1, max=200, help="idle processes for memory")] = 50,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where processes.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Processes: keystroke echo, output throughput over SSE, reattach after a resume, memory."""
    from pal.bench import processes as bench_processes

    bench_processes.main(
        iterations=iterations,
        size_mib=size_mib,
        idle_processes=idle_processes,
        data_dir=data_dir,
        out_dir=out_dir,
    )


@bench_app.command("peer")
def bench_peer(
    iterations: Annotated[int, typer.Option(min=1, help="iterations per workload size (p50/p90)")] = 20,
    platform: Annotated[str, typer.Option(help="runsc platform: ptrace, systrap or kvm")] = "ptrace",
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where peer-gvisor.md goes")] = Path("docs/benchmarks"),
) -> None:
    """gVisor (runsc) by the protocol of Pal's pause/resume rows, to put beside them.

    Checkpoint, restore, first exec after it and warm exec of a container running Pal's
    default image tree, its workload holding 0 and 64 MiB; every p50 also as a ratio to the
    peer's own warm exec. Needs root, runsc and a built default image in the data dir."""
    from pal.bench import peer as bench_peer

    if platform not in bench_peer.PLATFORMS:
        raise typer.BadParameter(f"--platform takes one of {', '.join(bench_peer.PLATFORMS)}")
    bench_peer.main(iterations=iterations, platform=platform, data_dir=data_dir, out_dir=out_dir)


if __name__ == "__main__":
    app()
