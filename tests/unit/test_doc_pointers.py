"""Docs and comments point only at files a reader of this repository has: no path into the
design notes outside it (`shared/...`), and every repo path a doc names in backquotes exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("pal/**/*.py"), *REPO.glob("scripts/*")]
OUTSIDE = re.compile(r"\bshared/(?:notes|spec|DESIGN)")
# `docs/x.md`, `pal/a/b.py`, `scripts/x.sh`, `deploy/x`: paths a doc names as this repo's
NAMED = re.compile(r"`((?:docs|pal|scripts|deploy|tests)/[\w./-]+\.\w+)`")


def test_nothing_points_outside_the_repository() -> None:
    bad = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in SOURCES
        if p.is_file()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert bad == [], "pointers to files not in this repository:\n" + "\n".join(bad)


def test_repo_paths_named_in_the_docs_exist() -> None:
    docs = [REPO / "README.md", *REPO.glob("docs/**/*.md")]
    missing = sorted(
        f"{d.relative_to(REPO)}: {m}"
        for d in docs
        for m in NAMED.findall(d.read_text())
        # docs/benchmarks/ holds what `pal bench` writes: a report may not be measured yet
        if not (REPO / m).exists() and "*" not in m and not m.startswith("docs/benchmarks/")
    )
    assert missing == [], "docs name files that do not exist:\n" + "\n".join(missing)
