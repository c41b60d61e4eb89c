"""Docs and comments point only at files a reader of this repository has: no path into the
design notes outside it (`shared/...`), no bare name of a file that lives only there, and
every repo path a doc names in backquotes exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [
    REPO / "README.md",
    *REPO.glob("docs/**/*.md"),
    *REPO.glob("pal/**/*.py"),
    *REPO.glob("scripts/*"),
    *REPO.glob("tests/**/*.py"),
]
HERE = Path(__file__).resolve()
OUTSIDE = re.compile(r"\bshared/(?:notes|spec|DESIGN)")
# The files of the design notes (shared/spec, shared/notes, shared/DESIGN.md), listed here
# rather than read: the notes are not part of a checkout, so the test must not need them.
# A comment citing one by its bare name sends the reader to a file they do not have; cite
# the repo doc that carries the point instead (docs/live-pause.md, docs/lifecycle.md, ...).
NOTES_FILES = (
    "microvm-lifecycle.txt",
    "pause-offload-resume.txt",
    "sandbox-lifecycle.txt",
    "network-on-these-hosts.md",
    "qemu-on-these-hosts.md",
    "DESIGN.md",
)
BARE = re.compile(r"(?<![\w/.-])(?:" + "|".join(re.escape(n) for n in NOTES_FILES) + r")\b")
# `docs/x.md`, `pal/a/b.py`, `scripts/x.sh`, `deploy/x`: paths a doc names as this repo's
NAMED = re.compile(r"`((?:docs|pal|scripts|deploy|tests)/[\w./-]+\.\w+)`")


def _lines_matching(pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in SOURCES
        if p.is_file() and p.resolve() != HERE
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]


def test_nothing_points_outside_the_repository() -> None:
    bad = _lines_matching(OUTSIDE)
    assert bad == [], "pointers to files not in this repository:\n" + "\n".join(bad)


def test_no_bare_name_of_a_design_note_file() -> None:
    bad = _lines_matching(BARE)
    assert bad == [], "names of files that are not in this repository:\n" + "\n".join(bad)


def test_the_bare_name_check_catches_what_it_names() -> None:
    # the check itself, on lines like the ones it exists to reject, and on ones it must let through
    assert BARE.search("Live pause (pause-offload-resume.txt): Pause")
    assert BARE.search("# see qemu-on-these-hosts.md")
    assert BARE.search("the layering in DESIGN.md")
    assert not BARE.search("see docs/live-pause.md and docs/lifecycle.md")
    assert not BARE.search("my-pause-offload-resume.txt.bak is mine")


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
