"""The README's tour, HTTP examples and SDK snippets, run verbatim against a real `pal up`,
in order, in one shell, as a new user would, and then run again: the README cannot rot,
and what it shows can be run twice on one server and leaves nothing running.

The blocks are the fenced ones after a `<!-- readme-test: NAME -->` comment, and the
README's TypeScript and Go examples (each built as a user's own project). Substituted, as a
user of this server would: its address for `localhost:8080`, and its data dir and URL in
the environment (`PAL_DATA_DIR`, `PAL_URL`). The shell runs in a scratch directory whose
`.venv` is the clone's, so `export PATH=$PWD/.venv/bin:$PATH` works as written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from pal.store import Store
from tests.conftest import REPO, PalServer
from tests.gosdk import go_program, readme_go_blocks

pytestmark = pytest.mark.vm

BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\n```(\w+)\n(.*?)```", re.S)
TS_BLOCK = re.compile(r"^```ts\n(.*?)^```", re.M | re.S)
SDK = REPO / "sdk" / "typescript"
RUNS = 2


def readme_blocks() -> dict[str, tuple[str, str]]:
    """name -> (language, code) of every tested block of README.md."""
    text = (REPO / "README.md").read_text()
    return {name: (lang, code) for name, lang, code in BLOCK.findall(text)}


def test_the_readme_marks_its_runnable_blocks() -> None:
    blocks = readme_blocks()
    assert list(blocks) == ["tour", "http", "cleanup", "sdk"]
    assert [lang for lang, _ in blocks.values()] == ["sh", "sh", "sh", "python"]


def left_running(server: PalServer, tenant: str) -> dict[str, str]:
    """The tenant's VMs that are not terminated, by id: what a run left behind."""
    store = Store(f"sqlite:///{server.data_dir / 'pal.db'}", run_migrations=False)
    try:
        (t,) = [t for t in store.list_tenants() if t.name == tenant]
        return {vm.vm_id: vm.state for vm in store.list_vms(tenant_id=t.id) if vm.state != "terminated"}
    finally:
        store.close()


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)  # hang guard
    assert res.returncode == 0, f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    return res.stdout


def test_the_readme_runs_top_to_bottom_twice(pal_server: PalServer, tenant_key: str, tmp_path: Path) -> None:
    del tenant_key  # only makes sure the warm template exists, as after a first `pal up`
    blocks = readme_blocks()
    host_port = pal_server.url.removeprefix("http://")
    shell = "\n".join(
        blocks[name][1].replace("localhost:8080", host_port) for name in ("tour", "http", "cleanup")
    )
    # The user then starts Python in the same shell (so with PAL_API_KEY exported).
    script = f"{shell}\npython3 - <<'README_SDK'\n{blocks['sdk'][1]}README_SDK\n"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PAL_")},
        "PAL_URL": pal_server.url,
        "PAL_DATA_DIR": str(pal_server.data_dir),
    }
    for run in range(1, RUNS + 1):
        where = tmp_path / f"run{run}"
        where.mkdir()
        (where / ".venv").symlink_to(REPO / ".venv")
        out = _run(["bash", "-euo", "pipefail", "-c", script], where, env)
        lines = out.splitlines()
        assert "hi" in lines and "0" in lines and "hi from job.py" in lines  # exec, --user root, python3
        assert ["1", "2", "3"] == [x for x in lines if x in ("1", "2", "3")][:3]  # the streamed loop
        assert "event: exit" in out and '"deleted":true' in out  # curl SSE and DELETE
        assert '"stdout":"s3cret\\n"' in out, "the HTTP block's VM ran with its secret"
        # the detached process read after the pause, from its first byte to its exit
        ticks = [
            json.loads(x.removeprefix("data: "))["data"] for x in lines if x.startswith('data: {"data":"tick')
        ]
        assert ticks == [f"tick {i}\n" for i in range(1, 5)], out
        assert "['tick 1', 'tick 2', 'tick 3', '']" in lines  # the SDK's, reattached across its pause
        # the tour's scratch files went to a temporary dir (cmp checked them) and were
        # removed: nothing is left where the user ran it (the clone)
        assert sorted(p.name for p in where.iterdir()) == [".venv"], list(where.iterdir())
        # the SDK's prints: the stream's output and exit (its `process` event is not data),
        # then the file it wrote
        assert "stdout a" in lines and "stdout b" in lines and lines[-2:] == ["exit 0", "print('hi')"]
        assert not [x for x in lines if x.startswith("process")], out
        assert left_running(pal_server, "demo") == {}, f"run {run} left VMs running"


def test_the_readmes_typescript_example_runs_twice(
    pal_server: PalServer, tenant_key: str, tmp_path: Path
) -> None:
    """README.md's TypeScript example, compiled in a user's project with the SDK's
    examples/tsconfig.json (Node's types), run twice on one tenant whose quota is exactly
    one run's VMs: the first run deleted what it made."""
    del tenant_key
    (code,) = TS_BLOCK.findall((REPO / "README.md").read_text())
    project = {"name": "my-agent", "private": True, "type": "module"}
    (tmp_path / "package.json").write_text(json.dumps(project))
    here = dict(os.environ)
    _run(["npm", "run", "-s", "build"], SDK, here)
    # the SDK as its README says (a `file:` dependency) and Node's types (the SDK's pinned copy)
    node_types = str(SDK / "node_modules" / "@types" / "node")
    _run(["npm", "install", "--no-audit", "--no-fund", "--offline", str(SDK), node_types], tmp_path, here)
    (tmp_path / "tsconfig.json").write_text((SDK / "examples" / "tsconfig.json").read_text())
    (tmp_path / "readme.ts").write_text(code)
    tsc = str(SDK / "node_modules" / "typescript" / "bin" / "tsc")
    _run(["node", tsc, "-p", "tsconfig.json"], tmp_path, here)
    env = {**os.environ, "PAL_URL": pal_server.url, "PAL_API_KEY": pal_server.tenant("readme-ts", max_vms=4)}
    for run in range(1, RUNS + 1):
        lines = _run(["node", "dist/readme.js"], tmp_path, env).splitlines()
        assert lines == ["hi", "exit 0", "forks: 3"], lines
        assert left_running(pal_server, "readme-ts") == {}, f"run {run} left VMs running"


def test_the_readmes_go_example_runs_twice(pal_server: PalServer, tenant_key: str, tmp_path: Path) -> None:
    """README.md's Go example (the spec's lifecycle snippet), built as a user's own module
    that requires the SDK, run twice on one tenant whose quota is one run's VMs."""
    del tenant_key
    (block,) = [b for b in readme_go_blocks(REPO / "README.md") if b.startswith("package main")]
    program = go_program(tmp_path, block)
    env = {**os.environ, "PAL_URL": pal_server.url, "PAL_API_KEY": pal_server.tenant("readme-go", max_vms=4)}
    for run in range(1, RUNS + 1):
        lines = _run([str(program)], tmp_path, env).splitlines()
        assert lines[0].startswith("snapshot ") and len(lines[0]) > len("snapshot "), lines
        assert lines[1:] == ["forks: 3", "print('hi') job.py", "hi", "exit 0"], lines
        assert left_running(pal_server, "readme-go") == {}, f"run {run} left VMs running"
