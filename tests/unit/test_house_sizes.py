"""The house's size rules (issue 24): no file over 700 lines and no function over 80 lines in
pal/ and the tools beside it (pal_tools/), so that each module and each function can be read
whole. Generated code is listed in GENERATED with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = (REPO / "pal", REPO / "pal_tools")
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80
# path in the repository -> why it is exempt
GENERATED: dict[str, str] = {
    f"pal/e2b/gen/{name}": "made by scripts/gen-e2b-proto.sh from pal/e2b/proto (test_e2b_proto.py)"
    for name in ("filesystem_pb.py", "process_pb.py", "filesystem_connect.py", "process_connect.py")
}


def _sources() -> list[Path]:
    return [
        p for root in ROOTS for p in sorted(root.rglob("*.py")) if str(p.relative_to(REPO)) not in GENERATED
    ]


def test_no_file_over_700_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n for p in _sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES
    }
    assert long == {}, f"split these files (lines): {long}"


def test_no_function_over_80_lines() -> None:
    long: dict[str, int] = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert long == {}, f"split these functions (lines): {long}"
