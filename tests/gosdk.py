"""Helpers for the Go SDK's tests: an offline `go` environment, the Go blocks of a README,
and building one as a user's own module that requires the SDK."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GO_SDK = REPO / "sdk" / "go"
MODULE = "github.com/pal-sandbox/pal/sdk/go"


def go_env() -> dict[str, str]:
    """`go` offline: the SDK is standard library only, and only PyPI, npm and Debian are
    reachable from CI, so any module download is a bug that must fail fast."""
    if not shutil.which("go"):
        pytest.fail("go is missing: run scripts/install.sh (it installs Debian's golang-go)")
    return {"GOPROXY": "off", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}


def readme_go_blocks(readme: Path) -> list[str]:
    return re.findall(r"^```go\n(.*?)^```", readme.read_text(), re.M | re.S)


def go_program(where: Path, source: str) -> Path:
    """Build ``source`` (a ``package main``) in a module of its own at ``where`` that requires
    the SDK by its import path (replaced by the checkout); ``go vet`` it too. The binary."""
    (where / "go.mod").write_text(
        "module example.com/quickstart\n\ngo 1.19\n\n"
        f"require {MODULE} v0.0.0\n\nreplace {MODULE} => {GO_SDK}\n"
    )
    (where / "main.go").write_text(source)
    env = {**os.environ, **go_env()}
    for args in (["go", "vet", "./..."], ["go", "build", "-o", "quickstart", "."]):
        res = subprocess.run(args, cwd=where, capture_output=True, text=True, timeout=600, env=env)
        assert res.returncode == 0, f"{' '.join(args)}:\n{res.stdout}{res.stderr}\n--- main.go:\n{source}"
    return where / "quickstart"
