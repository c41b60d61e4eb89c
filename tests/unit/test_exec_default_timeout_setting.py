"""PAL_EXEC_DEFAULT_TIMEOUT (pal/config.py): the default timeout of a buffered exec."""

from __future__ import annotations

import pytest

from pal.config import EXEC_DEFAULT_TIMEOUT_S, Settings
from pal.spec import MAX_EXEC_TIMEOUT_S


@pytest.mark.parametrize(
    ("raw", "secs"),
    [(None, EXEC_DEFAULT_TIMEOUT_S), ("", EXEC_DEFAULT_TIMEOUT_S), ("2.5", 2.5), ("0", None)],
)
def test_the_setting(monkeypatch: pytest.MonkeyPatch, raw: str | None, secs: float | None) -> None:
    if raw is None:
        monkeypatch.delenv("PAL_EXEC_DEFAULT_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("PAL_EXEC_DEFAULT_TIMEOUT", raw)
    assert Settings.from_env("/tmp/unused").exec_default_timeout_s == secs


def test_bounded_by_the_requests_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAL_EXEC_DEFAULT_TIMEOUT", str(MAX_EXEC_TIMEOUT_S * 10))
    assert Settings.from_env("/tmp/unused").exec_default_timeout_s == MAX_EXEC_TIMEOUT_S
    monkeypatch.setenv("PAL_EXEC_DEFAULT_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="PAL_EXEC_DEFAULT_TIMEOUT"):
        Settings.from_env("/tmp/unused")
