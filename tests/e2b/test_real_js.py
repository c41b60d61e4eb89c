"""The unmodified E2B JavaScript SDK (tests/e2b/js, from its lock file) under `node --test`
against a real `pal up` and real VMs, one at a time (js/real.test.mjs: a sandbox, then one
from its named snapshot)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.e2b.conftest import RealE2b

JS = Path(__file__).resolve().parent / "js"


def test_javascript_sdk_on_a_real_sandbox(real_e2b: RealE2b) -> None:
    assert shutil.which("node"), "node is missing: scripts/install.sh installs it"
    assert (JS / "node_modules" / "e2b").is_dir(), "run scripts/install.sh (npm ci in tests/e2b/js)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    done = subprocess.run(
        ["node", "--test", "real.test.mjs"],
        cwd=JS,
        env={**env, **real_e2b.env()},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# fail 0" in done.stdout
