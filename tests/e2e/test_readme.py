"""The README's tour, HTTP examples and SDK snippet, run verbatim against a real `pal up`,
in order, in one shell, as a new user would: the README cannot rot.

The blocks are the fenced ones after a `<!-- readme-test: NAME -->` comment. Substituted,
as a user of this server would: its address for `localhost:8080`, and its data dir and
URL in the environment (`PAL_DATA_DIR`, `PAL_URL`). The shell runs in a scratch directory
whose `.venv` is the clone's, so `export PATH=$PWD/.venv/bin:$PATH` works as written.
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

pytestmark = pytest.mark.vm

BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\n```(\w+)\n(.*?)```", re.S)


def readme_blocks() -> dict[str, tuple[str, str]]:
    """name -> (language, code) of every tested block of README.md."""
    text = (REPO / "README.md").read_text()
    return {name: (lang, code) for name, lang, code in BLOCK.findall(text)}


def test_the_readme_marks_its_runnable_blocks() -> None:
    blocks = readme_blocks()
    assert list(blocks) == ["tour", "http", "cleanup", "sdk"]
    assert [lang for lang, _ in blocks.values()] == ["sh", "sh", "sh", "python"]


def test_the_readme_runs_top_to_bottom(pal_server: PalServer, tenant_key: str, tmp_path: Path) -> None:
    del tenant_key  # only makes sure the warm template exists, as after a first `pal up`
    blocks = readme_blocks()
    host_port = pal_server.url.removeprefix("http://")
    shell = "\n".join(
        blocks[name][1].replace("localhost:8080", host_port) for name in ("tour", "http", "cleanup")
    )
    # The user then starts Python in the same shell (so with PAL_API_KEY exported).
    script = f"{shell}\npython3 - <<'README_SDK'\n{blocks['sdk'][1]}README_SDK\n"
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PAL_")},
        "PAL_URL": pal_server.url,
        "PAL_DATA_DIR": str(pal_server.data_dir),
    }
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed bound
    )
    out = res.stdout
    assert res.returncode == 0, f"exit {res.returncode}\n--- stdout\n{out}\n--- stderr\n{res.stderr}"
    lines = out.splitlines()
    assert "hi" in lines and "0" in lines and "hi from job.py" in lines  # exec, --user root, python3
    assert ["1", "2", "3"] == [x for x in lines if x in ("1", "2", "3")][:3]  # the streamed loop
    assert "event: exit" in out and '"deleted":true' in out  # curl SSE and DELETE
    # the detached process read after the pause, from its first byte to its exit
    ticks = [
        json.loads(x.removeprefix("data: "))["data"] for x in lines if x.startswith('data: {"data":"tick')
    ]
    assert ticks == [f"tick {i}\n" for i in range(1, 5)], out
    assert "['tick 1', 'tick 2', 'tick 3', '']" in lines  # the SDK's, reattached across its pause
    # the tour's scratch files went to a temporary dir (cmp checked them) and were removed:
    # nothing is left where the user ran it (the clone)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv"], list(tmp_path.iterdir())
    # the SDK's prints: the stream's events, then the file it wrote
    assert "stdout a" in lines and "stdout b" in lines and lines[-2:] == ["exit 0", "print('hi')"]
    # and nothing of the tour's tenant is left running
    store = Store(f"sqlite:///{pal_server.data_dir / 'pal.db'}", run_migrations=False)
    try:
        (demo,) = [t for t in store.list_tenants() if t.name == "demo"]
        states = {vm.state for vm in store.list_vms(tenant_id=demo.id)}
    finally:
        store.close()
    assert states == {"terminated"}, states
