"""The SDK's reading of a cell's answer (png as bytes) and `pal vm code`'s output: text
printed, images written to files, exit status 1 for an exception (pure logic: the server
side runs in tests/integration/test_code.py)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pal.cli import code as cli_code
from pal.cli.main import app
from pal.sdk.code import CodeResult, code_result

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
BODY = {
    "contextId": "default-python",
    "executionCount": 3,
    "stdout": "hi\n",
    "stderr": "",
    "results": [
        {"image/png": base64.b64encode(PNG).decode(), "text/plain": "<Figure>", "isMainResult": False},
        {"text/plain": "42", "isMainResult": True},
    ],
    "text": "42",
    "error": None,
    "timedOut": False,
}


def test_the_sdk_decodes_png_results() -> None:
    res = code_result(BODY)
    assert res.pngs == [PNG] and res.text == "42" and res.results[1].is_main_result
    assert res.results[0].text == "<Figure>" and res.error is None


class _Runtime:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def run_code(self, vm: str, code: str, **kw: Any) -> CodeResult:
        self.calls.append((vm, code, kw))
        return code_result(self.body)


class _Client:
    def __init__(self, rt: _Runtime) -> None:
        self.runtime = rt


def test_pal_vm_code_prints_text_and_writes_images(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rt = _Runtime(BODY)
    monkeypatch.setattr(cli_code, "client", lambda: _Client(rt))
    out = CliRunner().invoke(app, ["vm", "code", "vm-1", "-c", "x + 1", "--images", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "hi\n" in out.output and "42" in out.output
    assert (tmp_path / "cell3-0.png").read_bytes() == PNG
    assert rt.calls == [("vm-1", "x + 1", {"language": "python", "context": None, "timeout_secs": None})]


def test_pal_vm_code_exits_1_on_an_exception(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    body = {**BODY, "results": [], "text": None, "error": {"name": "E", "value": "v", "traceback": ["tb"]}}
    monkeypatch.setattr(cli_code, "client", lambda: _Client(_Runtime(body)))
    src = tmp_path / "cell.py"
    src.write_text("raise E")
    out = CliRunner().invoke(app, ["vm", "code", "vm-1", str(src)])
    assert out.exit_code == 1 and "tb" in out.output
