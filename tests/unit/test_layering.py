"""Every import follows the layering of docs/internals.md: the import-linter contracts in pyproject.toml
(layers of pal/'s packages, the guest's and the SDK's isolation, no cycles) hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

REPO = Path(__file__).resolve().parents[2]


def test_imports_follow_the_layering(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    status = lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert status == EXIT_STATUS_SUCCESS, report
