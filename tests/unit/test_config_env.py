"""Every environment variable the server side honours is read in pal/config.py, and the
README's Configuration table names each one: config.py's claim stays true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PAL = Path(__file__).resolve().parents[2] / "pal"
README = PAL.parent / "README.md"
# Files that may read the environment themselves, and why.
OTHER_READERS = {
    "sdk/_wire.py",  # the SDK's PAL_URL / PAL_API_KEY: it imports nothing else from pal
    "cli/vm.py",  # client side, through the SDK
    "cli/nodes.py",  # client side: PAL_URL of the server it talks to
    "guest/harness.py",  # runs inside the VM
    "guest/system.py",  # runs inside the VM (PID 1 sets its own environment)
    "bench.py",  # sets variables for the servers it starts
    "bench_network.py",
    "bench_cluster.py",
    "bench_s3.py",
    "localcluster/demo.py",  # a demo launcher for developers
    "localcluster/processes.py",  # passes the environment on to the processes it starts
    "network/control.py",  # passes chosen variables on to the gateway process
}
CLIENT_SIDE = {"PAL_URL", "PAL_API_KEY"}


def _env_reads(path: Path) -> set[str]:
    """Names of the variables ``path`` reads (os.environ.get/[], os.getenv, helpers)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func.endswith(("environ.get", "getenv", "_env", "environ.setdefault")):
                names.add(str(node.args[0].value))
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            if isinstance(node.slice, ast.Constant):
                names.add(str(node.slice.value))
    return names


def test_only_config_reads_the_servers_environment() -> None:
    strays = {}
    for path in sorted(PAL.rglob("*.py")):
        rel = str(path.relative_to(PAL))
        if rel == "config.py" or rel in OTHER_READERS:
            continue
        if re.search(r"\bos\.environ\b|\bgetenv\(", path.read_text()):
            strays[rel] = sorted(_env_reads(path)) or ["os.environ"]
    assert strays == {}, "read these in pal/config.py (Settings) instead"


def test_the_readme_lists_every_variable_config_reads() -> None:
    names = {n for n in _env_reads(PAL / "config.py") if n not in CLIENT_SIDE}
    assert len(names) > 20
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert missing == [], "add them to README.md's Configuration table"
