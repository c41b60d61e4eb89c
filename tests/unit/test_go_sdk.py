"""The Go SDK (sdk/go) without a server: standard library only, gofmt/vet clean, godoc on
every exported name, its own unit tests pass (`go test`, offline), and the Go quick starts
of README.md and sdk/go/README.md compile as a user's module. The contract against a real
server runs in tests/e2e/test_sdk_contract.py."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.gosdk import GO_SDK, MODULE, go_env, go_program, readme_go_blocks

REPO = Path(__file__).resolve().parents[2]


def _go(*args: str) -> str:
    res = subprocess.run(
        ["go", *args], cwd=GO_SDK, capture_output=True, text=True, timeout=600, env={**os.environ, **go_env()}
    )
    assert res.returncode == 0, f"go {' '.join(args)}:\n{res.stdout}{res.stderr}"
    return res.stdout


def test_the_module_uses_the_standard_library_only() -> None:
    gomod = (GO_SDK / "go.mod").read_text()
    assert gomod.startswith(f"module {MODULE}\n") and "require" not in gomod, gomod
    outside = _go("list", "-deps", "-test", "-f", "{{if not .Standard}}{{.ImportPath}}\n{{end}}", "./...")
    # Test variants are listed as "path [path.test]": the module's own packages only.
    paths = {line.split(" ")[0] for line in outside.splitlines() if line}
    assert paths <= {MODULE, MODULE + ".test", MODULE + "_test"}, outside


def test_vet_gofmt_and_the_unit_tests_pass() -> None:
    _go("vet", "./...")
    res = subprocess.run(["gofmt", "-l", "."], cwd=GO_SDK, capture_output=True, text=True, check=True)
    assert res.stdout == "", f"not gofmt-ed: {res.stdout}"
    out = _go("test", "-count=1", "-v", "./...")
    assert "--- FAIL" not in out and re.search(r"--- PASS: TestExecStreamYieldsEventsInOrder", out), out
    assert "--- SKIP: TestContract" in out  # without a server the contract waits for the e2e run


def test_every_exported_name_has_godoc() -> None:
    undocumented = []
    for f in sorted(GO_SDK.glob("*.go")):
        if f.name.endswith("_test.go"):
            continue
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^(?:func (?:\([^)]*\) )?|type )([A-Z]\w*)", line)
            start = i
            while start and lines[start - 1].startswith("//"):
                start -= 1  # the first line of the doc comment names the declaration
            if m and not (start < i and lines[start].startswith(f"// {m.group(1)}")):
                undocumented.append(f"{f.name}:{i + 1} {m.group(1)}")
    assert not undocumented, undocumented


def test_the_go_quick_starts_compile(tmp_path: Path) -> None:
    programs = [
        b
        for readme in (REPO / "README.md", GO_SDK / "README.md")
        for b in readme_go_blocks(readme)
        if b.startswith("package main")
    ]
    assert len(programs) >= 2, "README.md and sdk/go/README.md each carry a Go quick start"
    for i, source in enumerate(programs):
        where = tmp_path / f"p{i}"
        where.mkdir()
        assert go_program(where, source).exists()
