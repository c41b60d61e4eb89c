"""The unmodified E2B JavaScript SDK and @e2b/code-interpreter (tests/e2b/js, installed
from its lock file by scripts/install.sh) under `node --test`, against Pal's E2B surface."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.e2b.conftest import E2bServer

JS = Path(__file__).resolve().parent / "js"


def test_javascript_sdk(e2b_server: E2bServer) -> None:
    assert shutil.which("node"), "node is missing: scripts/install.sh installs it"
    assert (JS / "node_modules" / "e2b").is_dir(), "run scripts/install.sh (npm ci in tests/e2b/js)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    done = subprocess.run(
        ["node", "--test", "sdk.test.mjs"],
        cwd=JS,
        env={**env, **e2b_server.env()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# fail 0" in done.stdout
