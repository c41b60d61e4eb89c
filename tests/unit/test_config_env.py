"""Every environment variable the server side honours is declared in pal/config.py, and the
README's Configuration table is made from those declarations: config.py's claim stays true."""

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
    "guest/kerneldriver.py",  # runs inside the VM (Jupyter's runtime dir for its kernels)
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
        if rel in ("config.py", "config_env.py") or rel in OTHER_READERS:
            continue
        if re.search(r"\bos\.environ\b|\bgetenv\(", path.read_text()):
            strays[rel] = sorted(_env_reads(path)) or ["os.environ"]
    assert strays == {}, "read these in pal/config.py (Settings) instead"


def test_the_readme_table_is_the_declarations() -> None:
    from pal.config import Settings
    from pal.config_env import BEGIN, END, markdown

    text = README.read_text()
    table = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert table == markdown(Settings), "run: python -m pal.config --write"


def test_every_setting_declares_its_variable_once() -> None:
    from pal.config import Settings
    from pal.config_env import env_of

    names = [env_of(f).name for f in Settings.model_fields.values()]
    assert len(names) > 40 and len(set(names)) == len(names)
    assert all(env_of(f).doc for f in Settings.model_fields.values())
    # config.py reads no variable but through a declaration
    assert _env_reads(PAL / "config.py") <= set(names)
