"""`pal e2b env`: the lines an E2B user evals, and what the SDK makes of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from e2b import ConnectionConfig

from pal.cli.e2b import env_lines
from pal.e2b.keys import is_e2b_key, new_key
from tests.conftest import REPO


def _pal(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PAL_URL", "PAL_API_KEY")}
    return subprocess.run(
        [str(Path(sys.executable).parent / "pal"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**clean, **env},
        timeout=120,
    )


def test_env_prints_what_the_sdk_reads() -> None:
    key = new_key()
    assert is_e2b_key(key) and len(key) == 44
    done = _pal("e2b", "env", "--url", "http://10.0.0.5:8080", PAL_API_KEY=key)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "export E2B_API_URL=http://10.0.0.5:8080/e2b",
        "export E2B_VOLUME_API_URL=http://10.0.0.5:8080/e2b",
        "export E2B_SANDBOX_URL=http://10.0.0.5:49983",
        f"export E2B_API_KEY={key}",
    ]
    env = dict(line.removeprefix("export ").split("=", 1) for line in done.stdout.splitlines())
    config = ConnectionConfig(api_url=env["E2B_API_URL"], sandbox_url=env["E2B_SANDBOX_URL"], api_key=key)
    assert config.api_url == "http://10.0.0.5:8080/e2b"
    assert config.get_sandbox_url("vm-1", config.domain) == "http://10.0.0.5:49983"


def test_a_pal_key_turns_the_sdks_form_check_off() -> None:
    lines = env_lines("https://pal.example.com/", "pal_abc-_x", 9000)
    assert lines == [
        "export E2B_API_URL=https://pal.example.com/e2b",
        "export E2B_VOLUME_API_URL=https://pal.example.com/e2b",
        "export E2B_SANDBOX_URL=https://pal.example.com:9000",
        "export E2B_API_KEY=pal_abc-_x",
        "export E2B_VALIDATE_API_KEY=false",
    ]


def test_env_refuses_without_a_key_or_a_url() -> None:
    assert _pal("e2b", "env").returncode == 2
    bad = _pal("e2b", "env", "--url", "ftp://x", PAL_API_KEY=new_key())
    assert bad.returncode == 2 and "http(s) URL" in bad.stderr
