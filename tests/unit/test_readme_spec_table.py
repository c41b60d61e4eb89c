"""The README's table of the schedule body names every AgentSpec field (nested ones as
`limits.vcpus`, `placement.region`) and no field AgentSpec lacks, so it cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from pal.spec import AgentSpec

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([\w.]+)` \|")
# Objects written as one row (their own shape is in the row's text), not field by field.
ONE_ROW = {"waitPause", "egress", "secrets"}


def _wire_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, f in model.model_fields.items():
        key = prefix + (f.alias or name)
        sub = f.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and key not in ONE_ROW:
            out |= _wire_fields(sub, key + ".")
        else:
            out.add(key)
    return out


def test_the_readme_table_lists_every_agentspec_field() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("### The schedule body (AgentSpec)", 1)[1].split("\n#", 1)[0]
    documented = {m.group(1) for line in section.splitlines() if (m := ROW.match(line))}
    fields = _wire_fields(AgentSpec)
    assert fields - documented == set(), "AgentSpec fields missing from the README's table"
    assert documented - fields == set(), "the README's table names fields AgentSpec does not have"
