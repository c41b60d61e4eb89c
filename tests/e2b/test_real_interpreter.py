"""`e2b-code-interpreter`, unmodified, against a real `pal up`: `run_code` on Pal's
Jupyter kernels (the code-interpreter image, which tests/integration/test_code.py's
fixture builds; `code-interpreter-v1` is that image here)."""

from __future__ import annotations

from e2b_code_interpreter import Sandbox as CodeSandbox

from tests.e2b.conftest import RealE2b, e2b_environ
from tests.integration.test_code import code_image  # noqa: F401  (session fixture: the image)


def test_run_code_keeps_state_and_reports_errors(real_e2b: RealE2b, code_image: str) -> None:  # noqa: F811
    del code_image
    with e2b_environ(real_e2b):
        sbx = CodeSandbox.create(timeout=900)
        try:
            first = sbx.run_code("x = 41\nprint('set')")
            assert first.logs.stdout == ["set\n"] and first.error is None
            second = sbx.run_code("x + 1")
            assert second.text == "42"
            failed = sbx.run_code("1 / 0")
            assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        finally:
            sbx.kill()
