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


def test_restart_keeps_the_id_and_a_cells_envs_are_its_own(real_e2b: RealE2b, code_image: str) -> None:  # noqa: F811
    """A context's restart: the same id, a fresh kernel (its variables gone). A cell's
    ``envs``: in ``os.environ`` (and its subprocesses) for that cell, gone in the next, and
    a variable they shadowed is back; bash's too."""
    del code_image
    with e2b_environ(real_e2b):
        sbx = CodeSandbox.create(timeout=900, request_timeout=600)  # a kernel's start under TCG
        try:
            ctx = sbx.create_code_context()
            assert (
                sbx.run_code("y = 7\nimport os; os.environ['SHADOWED'] = 'before'", context=ctx).error is None
            )
            probe = "import os, subprocess\nprint(os.environ.get('CELL_ONLY'), os.environ['SHADOWED'], "
            probe += "subprocess.run('echo $CELL_ONLY', shell=True, capture_output=True, text=True)"
            probe += ".stdout.strip())"
            got = sbx.run_code(probe, context=ctx, envs={"CELL_ONLY": "here", "SHADOWED": "during"})
            assert got.error is None and got.logs.stdout == ["here during here\n"]
            after = sbx.run_code("print(os.environ.get('CELL_ONLY'), os.environ['SHADOWED'], y)", context=ctx)
            assert after.logs.stdout == ["None before 7\n"]
            sbx.restart_code_context(ctx)
            assert ctx.id in {c.id for c in sbx.list_code_contexts()}
            lost = sbx.run_code("y", context=ctx)
            assert lost.error is not None and lost.error.name == "NameError"
            assert sbx.run_code("1 + 1", context=ctx).text == "2"
            bash = sbx.run_code("echo ${CELL_ONLY-unset}", language="bash", envs={"CELL_ONLY": "b"})
            assert bash.logs.stdout == ["b\n"]
            assert sbx.run_code("echo ${CELL_ONLY-unset}", language="bash").logs.stdout == ["unset\n"]
        finally:
            sbx.kill()
