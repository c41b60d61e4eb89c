"""`pal bench`: the benchmarks, each writing its report under docs/benchmarks/ (their
modules are pal_tools/bench/*, imported when the command runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pal.sizes import DEFAULT_MEMORY_MIB, DEFAULT_PRESTART, size_name

from .image import DataDir

# A benchmark's own server runs on a data dir whose image is built already.
BenchDataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="a data dir with a built image (default PAL_TEST_DATA_DIR)")
]

bench_app = typer.Typer(
    help="Benchmarks: the latency table, `images`, `network`, `cluster`, `control-plane`, `wait`, "
    "`processes`, `io`, `e2b`,"
    " `memory`, `peer`."
)


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
    from pal_tools.bench import latency as bench_mod

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
    from pal_tools.bench import cluster as mod

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
    from pal_tools.bench import control_plane as mod
    from pal_tools.bench.simnode import SimTimes

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
    from pal_tools.bench import s3 as bench_s3

    bench_s3.main(iterations=iterations, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("density")
def bench_density(
    cap: Annotated[int, typer.Option(help="sandboxes at most (a shared machine: start modest)")] = 30,
    data_dir: BenchDataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where density.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Sandboxes of 256 MiB per node until it refuses one: per tier, memory, wakes, GET/list."""
    from pal_tools.bench import density

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
    from pal_tools.bench import network as bench_network

    bench_network.main(iterations=iterations, size_mib=size_mib, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("code")
def bench_code(
    iterations: Annotated[int, typer.Option(help="cells and schedules timed (p50/p90)")] = 10,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where code.md goes")] = Path("docs/benchmarks"),
) -> None:
    """The code interpreter against the same run's warm exec: a cell, schedule → first cell, fork ×5.

    Needs the code-interpreter image (`pal image build code-interpreter`)."""
    from pal_tools.bench import code as bench_code_mod

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
    from pal_tools.bench import images as bench_images

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
    from pal.config import Settings
    from pal_tools.bench import fanout as bench_fanout

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
    from pal.config import Settings
    from pal_tools.bench import prestart as bench_prestart

    bench_prestart.main(
        data_dir=data_dir or Settings.from_env().data_dir,
        out_dir=out_dir,
        iterations=iterations,
        rounds=rounds,
        memory_mib=memory_mib,
        prestart=f"{size_name(memory_mib)}:{DEFAULT_PRESTART[0][1]}",
    )


@bench_app.command("io")
def bench_io(
    rounds: Annotated[int, typer.Option(min=1, help="rounds per mode (unbounded and bounded alternate)")] = 3,
    seconds: Annotated[float, typer.Option(min=1, help="how long the quiet VM's writes are timed")] = 30,
    data_dir: BenchDataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where io.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Disk isolation: a VM's small synchronous writes beside a disk hog, with and without limits.

    The quiet VM's p50/p99 write latency alone and beside a VM writing as fast as it can,
    without per-VM disk limits and with the defaults (docs/benchmarks/io.md)."""
    from pal_tools.bench import io as bench_io_mod

    bench_io_mod.main(rounds=rounds, seconds=seconds, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("volumes")
def bench_volumes(
    rounds: Annotated[int, typer.Option(min=1, help="rounds (p50 over them)")] = 3,
    size_mib: Annotated[int, typer.Option(min=1, help="MiB written and read sequentially")] = 256,
    ops: Annotated[int, typer.Option(min=1, help="random 4 KiB reads and writes each")] = 2000,
    data_dir: BenchDataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where volumes.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Volumes: a volume against the sandbox's own disk; the mount's cost at schedule.

    Sequential and random read and write on a volume and on the sandbox's disk, schedule
    with and without a volume, two sandboxes writing one volume at once (docs/volumes.md)."""
    from pal_tools.bench import volumes as bench_volumes_mod

    bench_volumes_mod.main(rounds=rounds, size_mib=size_mib, ops=ops, data_dir=data_dir, out_dir=out_dir)


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
    from pal_tools.bench import wait as bench_wait

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
    from pal_tools.bench import processes as bench_processes

    bench_processes.main(
        iterations=iterations,
        size_mib=size_mib,
        idle_processes=idle_processes,
        data_dir=data_dir,
        out_dir=out_dir,
    )


@bench_app.command("e2b")
def bench_e2b(
    iterations: Annotated[int, typer.Option(min=1, help="iterations per row (p50/p90)")] = 10,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where e2b.md goes")] = Path("docs/benchmarks"),
) -> None:
    """E2B's SDK on Pal beside Pal's own SDK: create, run, 1 MiB files, pause → connect.

    Each row (create → first run, run warm, 1 MiB write+read, pause → connect → run) as the
    ratio to the same work through Pal's own SDK (issue 40's target: at most 1.2x)."""
    from pal_tools.bench import e2b as bench_e2b_mod

    bench_e2b_mod.main(iterations=iterations, data_dir=data_dir, out_dir=out_dir)


@bench_app.command("memory")
def bench_memory(
    label: Annotated[str, typer.Option(help="the run's name in memory.md (before, after)")] = "after",
    copies: Annotated[int, typer.Option(min=2, max=50, help="children forked at once")] = 10,
    state_mib: Annotated[int, typer.Option(min=1, max=192, help="random state the guest holds")] = 64,
    cycles: Annotated[int, typer.Option(min=1, help="pause/resume cycles of the long-lived VM")] = 30,
    cycle_mib: Annotated[int, typer.Option(min=1, max=128, help="allocated and freed per cycle")] = 32,
    memory_mib: Annotated[int, typer.Option(help="guest RAM of the measured VMs")] = DEFAULT_MEMORY_MIB,
    url: Annotated[
        str | None, typer.Option(help="measure a running server on this host (with --api-key)")
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="tenant key for --url")] = None,
    data_dir: DataDir = None,
    out_dir: Annotated[Path, typer.Option(help="where memory.md goes")] = Path("docs/benchmarks"),
) -> None:
    """Memory per sandbox with guest state: PSS per fork copy, a long-lived VM's cycles.

    Fork ×N of a guest holding random state (and an empty one): PSS per copy and how it
    came up; a VM through pause/resume cycles that allocate and free memory: its PSS and
    snapshot size (docs/benchmarks/memory.md). With --url, any Pal version running on this
    host is measured by the same protocol (the "before" of a change)."""
    from pal.config import Settings
    from pal_tools.bench import memory as bench_memory_mod

    bench_memory_mod.main(
        data_dir=data_dir or Settings.from_env().data_dir,
        out_dir=out_dir,
        label=label,
        url=url,
        api_key=api_key,
        memory_mib=memory_mib,
        copies=copies,
        state_mib=state_mib,
        cycles=cycles,
        cycle_mib=cycle_mib,
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
    from pal_tools.bench import peer as bench_peer

    if platform not in bench_peer.PLATFORMS:
        raise typer.BadParameter(f"--platform takes one of {', '.join(bench_peer.PLATFORMS)}")
    bench_peer.main(iterations=iterations, platform=platform, data_dir=data_dir, out_dir=out_dir)
