"""pal/e2b/gen is what scripts/gen-e2b-proto.sh makes of pal/e2b/proto today: an edited
interface file without regenerated code (or a hand-edited generated file) fails here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path: Path) -> None:
    assert shutil.which("protoc"), "protoc is missing: scripts/install.sh installs protobuf-compiler"
    subprocess.run(["bash", str(REPO / "scripts/gen-e2b-proto.sh"), str(tmp_path)], check=True)
    committed = REPO / "pal/e2b/gen"
    made = sorted(p.name for p in tmp_path.glob("*.py"))
    assert made == sorted(p.name for p in committed.glob("*.py") if p.name != "__init__.py")
    for name in made:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), f"regenerate {name}"
