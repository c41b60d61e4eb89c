"""The throwaway PostgreSQL of tests and demos finds Debian's programs of whichever major
is installed (Debian keeps them off PATH, in /usr/lib/postgresql/<major>/bin)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal_tools.localcluster import postgres


def test_the_newest_installed_major_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for major in ("9.6", "13", "17"):
        d = tmp_path / major / "bin"
        d.mkdir(parents=True)
        (d / "initdb").write_text("#!/bin/sh\n")
    (tmp_path / "16" / "bin").mkdir(parents=True)  # a major without initdb (a client-only package)
    (tmp_path / "16" / "bin" / "psql").write_text("#!/bin/sh\n")
    monkeypatch.setattr(postgres, "DEBIAN_BIN_GLOB", str(tmp_path / "*" / "bin"))
    dirs = postgres.bin_dirs()
    assert [d.parent.name for d in dirs[:4]] == ["17", "16", "13", "9.6"]
    assert postgres._bin("initdb") == str(tmp_path / "17" / "bin" / "initdb")
    (tmp_path / "17" / "bin" / "initdb").unlink()
    assert postgres._bin("initdb") == str(tmp_path / "13" / "bin" / "initdb")
