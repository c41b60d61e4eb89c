"""Progress of long work (pal/ops/progress.py): a rich bar on a terminal; in a log, a line
per step and, while a step lasts, a line now and then saying that it still runs."""

from __future__ import annotations

import io
import time

from rich.console import Console

from pal.ops.progress import Steps


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=100), out


def test_in_a_log_each_step_is_a_line_and_a_long_one_says_it_still_runs() -> None:
    console, out = _console(terminal=False)
    with Steps("image ci", console, every_s=0.05) as steps:
        steps("exporting the base", 0.02)
        steps("exporting the base", 0.04)  # the same step again: no new line
        steps.log("STEP 1/3: RUN pip install numpy")
        steps("buildah build", 0.05)
        deadline = time.monotonic() + 30
        while "still buildah build" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        "image ci: exporting the base (2%)",
        "STEP 1/3: RUN pip install numpy",
        "image ci: buildah build (5%)",
    ]
    assert any(x.startswith("image ci: still buildah build (") for x in lines), lines
    assert lines[-1].startswith("image ci: done in "), lines


def test_on_a_terminal_a_bar_with_the_step() -> None:
    console, out = _console(terminal=True)
    with Steps("template of x", console) as steps:
        steps("booting", 0.5)
    assert "template of x: booting" in out.getvalue()
    assert "still" not in out.getvalue(), "the bar's own clock says that, no extra lines"
